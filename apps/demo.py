"""Browser chat demo: `python apps/demo.py [--model qwen3-vl] [--host 127.0.0.1] [--port 7860]
[--share]`.

One Pipeline and one EngineLoop per process: every browser tab's request goes into the same engine,
whose single loop thread batches them (continuous batching), so the Gradio queue runs many chat
events at once instead of one at a time. Needs the demo extra: pip install -e ".[demo]" (gradio)."""
import argparse
import logging
import sys
from pathlib import Path

import gradio as gr

from vlinfer.cli.options import (FLAGS, add_engine_args, engine_options, flags_in_logs, name_flags,
                                 set_threads)
from vlinfer.config import ANSWER_MAX_TOKENS, CHAT_TEMPERATURE, CHAT_TOP_P
from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.multimodal.video_io import VIDEO_EXTENSIONS

logger = logging.getLogger("vlinfer.demo")

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples" / "images"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp"}
# Assistant messages with this title are notices from the demo (a rejected request), not model
# answers: they and the user turn they answer are left out of what the model sees on later turns.
NOTICE_TITLE = "Not answered"
# a thinking model's reasoning: shown folded (Gradio renders a titled message as a collapsible
# block) above the answer, and never sent back to the model
THINKING_TITLE = "Thinking"
CONCURRENCY = 16  # chat events the Gradio queue runs at once; the engine batches them
MAX_TOKENS_LIMIT = 4096
# The sliders' starting values: a chat UI's (README.md "Defaults" says why they differ from LLM's).
SAMPLING_DEFAULTS = {
    "temperature": CHAT_TEMPERATURE, "top_p": CHAT_TOP_P, "max_tokens": ANSWER_MAX_TOKENS
}
# The engine's messages name this app's flags; --concurrency is its max_num_seqs.
DEMO_FLAGS = {**FLAGS, "max_num_seqs": "--concurrency"}
EMPTY_INPUT = {"text": "", "files": []}
# Gradio shows chat images at full width; thumbnails keep a multi-image turn and its answer on one
# screen. (Gradio 6 takes CSS in launch(): callers of build_demo pass css=DEMO_CSS there.)
DEMO_CSS = "#chat .image-container img { max-height: 110px; width: auto; }"


# ---- chat history (Gradio messages) -> model messages (OpenAI-style parts) ----
def _file_path(part) -> str | None:
    """The local path of a file part in any of the shapes Gradio hands over."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        # normalized chatbot content: {"type": "file", "file": {...}}
        if isinstance(part.get("file"), dict):
            return part["file"].get("path")
        return part.get("path")
    return getattr(part, "path", None)  # a FileData object


def is_video_file(path: str) -> bool:
    """Uploads are told apart by name: Gradio keeps the uploaded file's extension."""
    return path.lower().endswith(VIDEO_EXTENSIONS)


def is_notice(message: dict) -> bool:
    return (message.get("metadata") or {}).get("title") == NOTICE_TITLE


def is_thinking(message: dict) -> bool:
    return (message.get("metadata") or {}).get("title") == THINKING_TITLE


def answer_messages(reasoning: str, answer: str) -> list[dict]:
    """The assistant's turn as shown: its thinking folded (pending until the answer starts), then
    the answer."""
    shown = []
    if reasoning:
        shown.append({"role": "assistant", "content": reasoning,
                      "metadata": {"title": THINKING_TITLE,
                                   "status": "done" if answer else "pending"}})
    if answer or not reasoning:
        shown.append({"role": "assistant", "content": answer})
    return shown


def model_messages(history: list[dict]) -> list[dict]:
    """Chatbot history -> OpenAI-style messages: user images become {"type": "image", "image": path}
    parts, videos {"type": "video", "video": path} parts (sampled at the model's default fps), text
    becomes {"type": "text"} parts; assistant turns are plain strings. Notices and the turns they
    reject are dropped, so one bad image does not break every later turn."""
    out: list[dict] = []
    for message in history or []:
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            continue
        if is_thinking(message):  # shown only: the templates drop past thinking anyway
            continue
        if is_notice(message):
            # the rejected turn (a turn may span several messages)
            while out and out[-1]["role"] == "user":
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
                path = _file_path(part)
                parts.append({"type": "video", "video": path} if is_video_file(path) else
                             {"type": "image", "image": path})
            # anything else (components rendered in the chat) is display only
        if role != "user":  # only user turns carry images
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            if text:
                out.append({"role": role, "content": text})
        elif parts:
            out.append({"role": "user", "content": parts})
    return out


def count_images(messages: list[dict], kind: str = "image") -> int:
    return sum(
        part.get("type") == kind for m in messages if isinstance(m["content"], list)
        for part in m["content"])


def read_input(message) -> tuple[str, list[str]]:
    """(text, image paths) from the MultimodalTextbox value (a dict; a plain string from API
    callers)."""
    if isinstance(message, str):
        return message.strip(), []
    message = message or {}
    files = [_file_path(f) for f in message.get("files") or []]
    return (message.get("text") or "").strip(), [f for f in files if f]


def user_message(text: str, files: list[str]) -> dict:
    return {"role": "user", "content": [{"path": f} for f in files] + ([text] if text else [])}


def notice(text: str) -> dict:
    return {
        "role": "assistant", "content": text, "metadata": {"title": NOTICE_TITLE, "status": "done"}
    }


def example_images(folder: Path = EXAMPLES_DIR) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


# ---- the app ----
def build_demo(pipe, loop: EngineLoop | None = None) -> gr.Blocks:
    """The Blocks app for one Pipeline. Pass `loop` when an EngineLoop already drives pipe.engine:
    two loops stepping one engine would race."""
    loop = loop or EngineLoop(pipe.engine)
    engine = pipe.engine
    images = example_images()

    def respond(message, history, temperature, top_p, max_tokens):
        """Streams the answer: yields (chat history, textbox) as deltas arrive. Stop / Clear / a
        closed tab close this generator, and its finally aborts the request so the engine frees its
        KV blocks at once."""
        text, files = read_input(message)
        history = list(history or [])
        if not text and not files:
            gr.Warning("Type a question or attach an image or a video.")
            yield history, gr.skip()
            return
        shown = history + [user_message(text, files)]
        try:
            # images and videos first, then the text; ValueError when unusable
            turn = pipe.messages(text or None, [f for f in files if not is_video_file(f)],
                                 [f for f in files if is_video_file(f)])
            params = pipe.sampling_params(temperature=float(temperature), top_p=float(top_p),
                                          max_tokens=int(max_tokens))
            messages = model_messages(history) + turn
            stream = loop.submit(engine.chat_prompt(messages), params)
            videos = count_images(messages, "video")
            logger.info("request %s: %d messages, %d images, %smax_tokens=%d", stream.request_id,
                        len(messages), count_images(messages),
                        f"{videos} videos, " if videos else "", params.max_tokens)
        # a bad image or video, a prompt too long, bad sampling values: tell the user
        except ValueError as e:
            logger.info("rejected a request: %s", e)
            gr.Warning(f"Request rejected: {e}")
            yield shown + [notice(f"⚠️ Request rejected: {e}")], EMPTY_INPUT
            return
        answer = reasoning = ""
        try:
            yield shown, EMPTY_INPUT  # show the user's turn and clear the box right away
            for out in stream:
                c = out.outputs[0]
                if not (c.delta_text or c.delta_reasoning):
                    continue
                answer, reasoning = answer + c.delta_text, reasoning + c.delta_reasoning
                # gr.skip(): leave the textbox alone, the user may be typing the next question
                yield shown + answer_messages(reasoning, answer), gr.skip()
        # the engine loop failed this request (logged there with the traceback)
        except RuntimeError as e:
            gr.Warning(str(e))
            yield shown + answer_messages(reasoning, answer) + [notice(f"⚠️ {e}")], gr.skip()
        except GeneratorExit:  # Stop, Clear or a closed tab: Gradio closed this generator
            # mid-answer: say so, an abort is otherwise invisible from outside
            if stream.final is None:
                logger.info("request %s: stopped before it finished, aborted in the engine",
                            stream.request_id)
            raise
        finally:
            stream.abort()  # a no-op when it finished; on Stop it frees the request in the engine

    def attach_example(message, evt: gr.SelectData):
        """A click on an example image adds it to the message being written (click several for a
        multi-image question), with a starter question when the box is empty."""
        text, files = read_input(message)
        return {"text": text or "Describe this image.", "files": files + [str(images[evt.index])]}

    def engine_status() -> str:
        return f"Requests in the engine now: **{loop.num_active()}** (all tabs share one batch)"

    embedded_notice = (
        f"> ⚠️ **This is {engine.source.about}.** It shows the engine working (images in, streamed "
        "tokens out, "
        "batching across tabs) without the real weights. "
        "For real answers: `huggingface-cli download Qwen/Qwen3-VL-2B-Instruct`, then restart.")
    with gr.Blocks(title="vlinfer demo") as demo:
        gr.Markdown(
            f"# vlinfer chat\n**Model:** `{pipe.model}` ({engine.source.path}) · **Device:** "
            f"`{pipe.device}` · **dtype:** `{str(engine.dtype).removeprefix('torch.')}` · "
            f"**max context:** {engine.max_model_len} tokens")
        if pipe.embedded:
            gr.Markdown(embedded_notice, elem_id="embedded-notice")
        with gr.Row():
            with gr.Column(scale=2):
                chatbot = gr.Chatbot(label="Chat", height=480, buttons=["copy"], elem_id="chat",
                                     placeholder="Attach images or a video and ask about them."
                                     if pipe.is_multimodal else "Ask a question.")
                textbox = gr.MultimodalTextbox(
                    file_types=["image", "video"], file_count="multiple",
                    sources=["upload"] if pipe.is_multimodal else [], placeholder=
                    "Ask about images or videos (the clip attaches one or several), Enter to send"
                    if pipe.is_multimodal else "Ask a question, Enter to send (text-only model)",
                    label="message", show_label=False, autofocus=True)
                with gr.Row():
                    stop = gr.Button("Stop", variant="stop")
                    clear = gr.Button("Clear")
            with gr.Column(scale=1):
                temperature = gr.Slider(0.0, 2.0, value=SAMPLING_DEFAULTS["temperature"], step=0.05,
                                        label="Temperature", info="0 = greedy")
                top_p = gr.Slider(0.05, 1.0, value=SAMPLING_DEFAULTS["top_p"], step=0.05,
                                  label="Top-p")
                most_tokens = min(MAX_TOKENS_LIMIT, engine.max_model_len)
                max_tokens = gr.Slider(1, most_tokens, value=min(SAMPLING_DEFAULTS["max_tokens"],
                                                                 most_tokens), step=1,
                                       label="Max new tokens")
                status = gr.Markdown(engine_status(), label="engine status")
                gallery = None
                if images and pipe.is_multimodal:  # only when examples/images holds pictures
                    gallery = gr.Gallery([(str(p), p.stem)
                                          for p in images], label="Examples: click to attach",
                                         columns=3, height=290, allow_preview=False,
                                         interactive=False, object_fit="contain", buttons=[])

        chat = textbox.submit(respond, [textbox, chatbot, temperature, top_p, max_tokens],
                              [chatbot, textbox], api_name="chat", show_progress="minimal")
        # fn=None: the browser cancels the running chat event; Gradio then closes the generator
        # (finally: abort)
        stop.click(None, None, None, cancels=[chat], api_visibility="private")
        clear.click(lambda: ([], EMPTY_INPUT), None, [chatbot, textbox], cancels=[chat],
                    queue=False, api_visibility="private")
        if gallery is not None:
            gallery.select(attach_example, [textbox], [textbox], api_visibility="private",
                           queue=False)
        # Status polls must never wait behind chats in the queue: no concurrency limit.
        gr.Timer(2.0).tick(engine_status, None, status, api_name="engine_status",
                           concurrency_limit=None, show_progress="hidden")
    demo.engine_loop = loop  # for callers that want to close it
    return demo


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="vlinfer browser chat demo (Gradio)")
    p.add_argument(
        "--model", default="qwen3-vl", help=
        "alias, local folder, .gguf or HF repo id (default qwen3-vl; without its weights on this "
        "machine it falls back to the embedded toy model, which knows only drawn scenes)")
    p.add_argument("--host", default="127.0.0.1",
                   help="default: 127.0.0.1 (this machine only); 0.0.0.0 serves the network")
    p.add_argument("--port", type=int, default=7860, help="default: %(default)s")
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    # --max-model-len counts images too: ~1 token per 32x32 pixels
    add_engine_args(p, max_num_seqs=False)
    p.add_argument(
        "--concurrency", type=int, default=CONCURRENCY,
        help=f"chat requests served at once, batched by the engine: its max_num_seqs (default: "
        f"{CONCURRENCY})")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def demo_engine_options(args: argparse.Namespace) -> dict:
    # max_num_seqs: the queue never runs more chats at once, so a larger KV pool would be memory
    # never used.
    return {**engine_options(args), "max_num_seqs": args.concurrency}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # gradio's own startup probes, one line each
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from vlinfer.pipeline import Pipeline
    with flags_in_logs(DEMO_FLAGS):
        try:
            set_threads(args)
            pipe = Pipeline(args.model, **demo_engine_options(args))
        # a mistyped --device, a KV budget too small, no model
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {name_flags(str(e), DEMO_FLAGS)}", file=sys.stderr)
            return 2
        demo = build_demo(pipe)
        demo.queue(default_concurrency_limit=args.concurrency)
        try:
            demo.launch(server_name=args.host, server_port=args.port, share=args.share,
                        css=DEMO_CSS, allowed_paths=[str(EXAMPLES_DIR)])
        finally:
            demo.engine_loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
