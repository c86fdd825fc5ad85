"""Browser chat demo: `python apps/demo.py [--model qwen3-vl] [--host 127.0.0.1] [--port 7860] [--share]`.

One Pipeline and one EngineLoop per process: every browser tab's request goes into the same engine, whose single
loop thread batches them (continuous batching), so the Gradio queue runs many chat events at once instead of
one at a time. Needs the demo extra: pip install -e ".[demo]" (gradio)."""
import argparse
import logging
from pathlib import Path

import gradio as gr

from vlinfer.__main__ import _size as parse_size
from vlinfer.config import APP_MAX_MODEL_LEN
from vlinfer.engine.engine_loop import EngineLoop

logger = logging.getLogger("vlinfer.demo")

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples" / "images"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp"}
# Assistant messages with this title are notices from the demo (a rejected request), not model answers: they
# and the user turn they answer are left out of what the model sees on later turns.
NOTICE_TITLE = "Not answered"
CONCURRENCY = 16  # chat events the Gradio queue runs at once; the engine batches them
MAX_TOKENS_LIMIT = 4096
EMPTY_INPUT = {"text": "", "files": []}
# Gradio shows chat images at full width; thumbnails keep a multi-image turn and its answer on one screen.
# (Gradio 6 takes CSS in launch(): callers of build_demo pass css=DEMO_CSS there.)
DEMO_CSS = "#chat .image-container img { max-height: 110px; width: auto; }"


# ---- chat history (Gradio messages) -> model messages (OpenAI-style parts) ----
def _file_path(part) -> str | None:
    """The local path of a file part in any of the shapes Gradio hands over."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        if isinstance(part.get("file"), dict):  # normalized chatbot content: {"type": "file", "file": {...}}
            return part["file"].get("path")
        return part.get("path")
    return getattr(part, "path", None)  # a FileData object


def is_notice(message: dict) -> bool:
    return (message.get("metadata") or {}).get("title") == NOTICE_TITLE


def model_messages(history: list[dict]) -> list[dict]:
    """Chatbot history -> OpenAI-style messages: user images become {"type": "image", "image": path} parts,
    text becomes {"type": "text"} parts; assistant turns are plain strings. Notices and the turns they reject
    are dropped, so one bad image does not break every later turn."""
    out: list[dict] = []
    for message in history or []:
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            continue
        if is_notice(message):
            while out and out[-1]["role"] == "user":  # the rejected turn (a turn may span several messages)
                out.pop()
            continue
        content = message.get("content")
        content = content if isinstance(content, list) else [content]
        parts = []
        for part in content:
            if part is None:
                continue
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif isinstance(part, dict) and part.get("type") == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif role == "user" and _file_path(part):
                parts.append({"type": "image", "image": _file_path(part)})
            # anything else (components rendered in the chat) is display only
        if role != "user":  # only user turns carry images
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            if text:
                out.append({"role": role, "content": text})
        elif parts:
            out.append({"role": "user", "content": parts})
    return out


def count_images(messages: list[dict]) -> int:
    return sum(part.get("type") == "image" for m in messages if isinstance(m["content"], list) for part in m["content"])


def read_input(message) -> tuple[str, list[str]]:
    """(text, image paths) from the MultimodalTextbox value (a dict; a plain string from API callers)."""
    if isinstance(message, str):
        return message.strip(), []
    message = message or {}
    files = [_file_path(f) for f in message.get("files") or []]
    return (message.get("text") or "").strip(), [f for f in files if f]


def user_message(text: str, files: list[str]) -> dict:
    return {"role": "user", "content": [{"path": f} for f in files] + ([text] if text else [])}


def notice(text: str) -> dict:
    return {"role": "assistant", "content": text, "metadata": {"title": NOTICE_TITLE, "status": "done"}}


def example_images(folder: Path = EXAMPLES_DIR) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


# ---- the app ----
def build_demo(pipe, loop: EngineLoop | None = None) -> gr.Blocks:
    """The Blocks app for one Pipeline. Pass `loop` when an EngineLoop already drives pipe.engine: two loops
    stepping one engine would race."""
    loop = loop or EngineLoop(pipe.engine)
    engine = pipe.engine
    images = example_images()

    def respond(message, history, temperature, top_p, max_tokens):
        """Streams the answer: yields (chat history, textbox) as deltas arrive. Stop / Clear / a closed tab
        close this generator, and its finally aborts the request so the engine frees its KV blocks at once."""
        text, files = read_input(message)
        history = list(history or [])
        if not text and not files:
            gr.Warning("Type a question or attach an image.")
            yield history, gr.skip()
            return
        shown = history + [user_message(text, files)]
        try:
            turn = pipe.messages(text or None, files)  # images first, then the text; ValueError when unusable
            params = pipe.sampling_params(temperature=float(temperature), top_p=float(top_p),
                                          max_tokens=int(max_tokens))
            messages = model_messages(history) + turn
            stream = loop.submit(engine.chat_prompt(messages), params)
            logger.info("request %s: %d messages, %d images, max_tokens=%d", stream.request_id, len(messages),
                        count_images(messages), params.max_tokens)
        except ValueError as e:  # a bad image, a prompt too long, bad sampling values: tell the user, keep serving
            logger.info("rejected a request: %s", e)
            gr.Warning(f"Request rejected: {e}")
            yield shown + [notice(f"⚠️ Request rejected: {e}")], EMPTY_INPUT
            return
        answer = ""
        try:
            yield shown, EMPTY_INPUT  # show the user's turn and clear the box right away
            for delta in stream.deltas():
                answer += delta
                # gr.skip(): leave the textbox alone, the user may be typing the next question
                yield shown + [{"role": "assistant", "content": answer}], gr.skip()
        except RuntimeError as e:  # the engine loop failed this request (logged there with the traceback)
            gr.Warning(str(e))
            yield shown + [{"role": "assistant", "content": answer}, notice(f"⚠️ {e}")], gr.skip()
        finally:
            stream.abort()  # a no-op when it finished; on Stop it frees the request in the engine

    def attach_example(message, evt: gr.SelectData):
        """A click on an example image adds it to the message being written (click several for a multi-image
        question), with a starter question when the box is empty."""
        text, files = read_input(message)
        return {"text": text or "Describe this image.", "files": files + [str(images[evt.index])]}

    def engine_status() -> str:
        return f"Requests in the engine now: **{loop.num_active()}** (all tabs share one batch)"

    embedded_notice = (
        "> ⚠️ **This is vlinfer's embedded tiny random-weight Qwen3-VL: its words are meaningless.** It shows "
        "the engine working (images in, streamed tokens out, batching across tabs) without the real weights. "
        "For real answers: `huggingface-cli download Qwen/Qwen3-VL-2B-Instruct`, then restart.")
    with gr.Blocks(title="vlinfer demo") as demo:
        gr.Markdown(f"# vlinfer chat\n**Model:** `{pipe.model}` ({engine.source.path}) · **Device:** "
                    f"`{pipe.device}` · **dtype:** `{str(engine.dtype).removeprefix('torch.')}` · "
                    f"**max context:** {engine.max_model_len} tokens")
        if pipe.embedded:
            gr.Markdown(embedded_notice, elem_id="embedded-notice")
        with gr.Row():
            with gr.Column(scale=2):
                chatbot = gr.Chatbot(label="Chat", height=480, buttons=["copy"], elem_id="chat",
                                     placeholder="Attach one or more images and ask about them."
                                     if pipe.is_multimodal else "Ask a question.")
                textbox = gr.MultimodalTextbox(
                    file_types=["image"], file_count="multiple", sources=["upload"] if pipe.is_multimodal else [],
                    placeholder="Ask about the images (the clip attaches one or several), Enter to send"
                    if pipe.is_multimodal else "Ask a question, Enter to send (text-only model)",
                    label="message", show_label=False, autofocus=True)
                with gr.Row():
                    stop = gr.Button("Stop", variant="stop")
                    clear = gr.Button("Clear")
            with gr.Column(scale=1):
                temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature",
                                        info="0 = greedy")
                top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="Top-p")
                max_tokens = gr.Slider(1, min(MAX_TOKENS_LIMIT, engine.max_model_len), value=256, step=1,
                                       label="Max new tokens")
                status = gr.Markdown(engine_status(), label="engine status")
                gallery = None
                if images and pipe.is_multimodal:  # only when examples/images holds pictures
                    gallery = gr.Gallery([(str(p), p.stem) for p in images], label="Examples: click to attach",
                                         columns=3, height=290, allow_preview=False, interactive=False,
                                         object_fit="contain", buttons=[])

        chat = textbox.submit(respond, [textbox, chatbot, temperature, top_p, max_tokens], [chatbot, textbox],
                              api_name="chat", show_progress="minimal")
        # fn=None: the browser cancels the running chat event; Gradio then closes the generator (finally: abort)
        stop.click(None, None, None, cancels=[chat], api_visibility="private")
        clear.click(lambda: ([], EMPTY_INPUT), None, [chatbot, textbox], cancels=[chat], queue=False,
                    api_visibility="private")
        if gallery is not None:
            gallery.select(attach_example, [textbox], [textbox], api_visibility="private", queue=False)
        # Status polls must never wait behind chats in the queue: no concurrency limit.
        gr.Timer(2.0).tick(engine_status, None, status, api_name="engine_status", concurrency_limit=None,
                           show_progress="hidden")
    demo.engine_loop = loop  # for callers that want to close it
    return demo


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="vlinfer browser chat demo (Gradio)")
    p.add_argument("--model", default="qwen3-vl",
                   help="alias, local folder, .gguf or HF repo id (default qwen3-vl; without its weights on this "
                        "machine it falls back to the embedded random-weight model)")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve the local network")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length per conversation (images count: ~1 token per 32x32 pixels); default: the "
                        f"model's own, at most {APP_MAX_MODEL_LEN}, and at most what the KV cache holds")
    p.add_argument("--kv-cache-size", type=parse_size, default=None, metavar="SIZE",
                   help="KV cache pool, e.g. 512M or 2G (default: a share of free memory)")
    p.add_argument("--concurrency", type=int, default=CONCURRENCY,
                   help="chat requests served at once (batched by the engine)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own startup probes, one line each
    from vlinfer.pipeline import Pipeline
    # max_num_seqs: the queue never runs more chats at once, so a larger KV pool would be memory never used.
    options = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                   max_model_len_cap=APP_MAX_MODEL_LEN, max_num_seqs=args.concurrency)
    if args.kv_cache_size is not None:
        options["kv_cache_bytes"] = args.kv_cache_size
    pipe = Pipeline(args.model, **options)
    demo = build_demo(pipe)
    demo.queue(default_concurrency_limit=args.concurrency)
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=args.share, css=DEMO_CSS,
                    allowed_paths=[str(EXAMPLES_DIR)])
    finally:
        demo.engine_loop.close()


if __name__ == "__main__":
    main()
