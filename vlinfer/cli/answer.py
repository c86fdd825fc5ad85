"""`vlinfer generate` (one answer) and `vlinfer chat` (an interactive chat, answers streamed)."""
import os
import sys

from vlinfer.cli.options import name_flags
from vlinfer.cli.shared import (CLI_FLAGS, TEXT_MODEL, VISION_MODEL, add_lora_arg, add_max_pixels,
                                add_model_args, add_sampling_args, build_llm, lora_request,
                                mm_kwargs, sampling_params)
from vlinfer.config import ANSWER_MAX_TOKENS, CHAT_TEMPERATURE, CHAT_TOP_P


def cmd_generate(args) -> int:
    model = args.model or (VISION_MODEL if args.image else TEXT_MODEL)
    llm = build_llm(args, model)
    # the prompt as written; images need their <|vision_start|><|image_pad|><|vision_end|> in it
    if args.raw:
        prompt = {"prompt": args.prompt}
        if args.image:
            prompt["multi_modal_data"] = {"image": list(args.image)}
        image_kwargs = mm_kwargs(args, llm)
        if image_kwargs:
            prompt["mm_processor_kwargs"] = image_kwargs
        out = llm.generate(prompt, sampling_params(args), use_tqdm=False,
                           lora_request=lora_request(args))[0]
    else:
        content = args.prompt
        if args.image:  # images first, then the text: the layout Qwen3-VL was trained on
            content = [{"type": "image", "image": path} for path in args.image]
            content.append({"type": "text", "text": args.prompt})
        out = llm.chat([{"role": "user", "content": content}], sampling_params(args),
                       use_tqdm=False, mm_processor_kwargs=mm_kwargs(args, llm),
                       lora_request=lora_request(args),
                       chat_template_kwargs=thinking_kwargs(args))[0]
    if out.outputs[0].reasoning is not None:
        print(f"{THINKING_OPEN}{out.outputs[0].reasoning}{THINKING_CLOSE}", end="")
    print(out.outputs[0].text)
    return 0


# How the CLI marks a thinking model's reasoning (the parser's `reasoning`) before its answer.
THINKING_OPEN, THINKING_CLOSE = "[thinking]\n", "\n[/thinking]\n"


def thinking_kwargs(args) -> dict | None:
    """--no-thinking as the chat template's variable (Qwen3's and Qwen3.5's enable_thinking)."""
    return {"enable_thinking": False} if args.no_thinking else None


CHAT_HELP = ("/image PATH attaches an image to your next message, /reset clears the history, "
             "/exit quits")


def _stream_answer(engine, request_id: str) -> str | None:
    """Print the answer as it arrives; None when interrupted (the request is aborted, its blocks
    freed)."""
    from vlinfer.engine.drive import drive  # here: --help imports no engine (cli/__init__.py)
    answer, thinking = "", False
    try:
        for out in drive(engine, [request_id]):
            c = out.outputs[0]
            if c.delta_reasoning and not thinking:
                print(THINKING_OPEN, end="", flush=True)
                thinking = True
            if thinking and (c.delta_text or out.finished):
                print(c.delta_reasoning + THINKING_CLOSE, end="", flush=True)
                thinking = False
            elif c.delta_reasoning:
                print(c.delta_reasoning, end="", flush=True)
            print(c.delta_text, end="", flush=True)
            answer = c.text
    except KeyboardInterrupt:  # drive aborted the request
        print("\n(interrupted)", file=sys.stderr)
        return None
    print()
    return answer


def cmd_chat(args) -> int:
    model = args.model or TEXT_MODEL
    llm = build_llm(args, model)
    engine = llm.engine
    params = sampling_params(args)
    image_kwargs = mm_kwargs(args, llm)
    lora = lora_request(args)
    kind = "vision" if engine.is_multimodal else "text-only"
    if lora is not None:
        kind += f"; LoRA adapter {lora.lora_name!r}"
    if engine.source.embedded:
        kind += f"; {engine.source.about}"
    print(f"chatting with {model} ({kind}); {CHAT_HELP}", file=sys.stderr)
    history: list[dict] = []
    pending: list[str] = []  # images for the next message
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history, pending = [], []
            print("(history cleared)", file=sys.stderr)
            continue
        if line == "/image" or line.startswith("/image "):
            path = line[len("/image"):].strip()
            if not engine.is_multimodal:
                from vlinfer.inputs.limits import text_only
                print(
                    f"error: {text_only(model, 'images')}; start the chat with a vision model, "
                    "e.g. "
                    f"--model {VISION_MODEL}", file=sys.stderr)
            elif not path:
                print("usage: /image PATH", file=sys.stderr)
            elif not os.path.isfile(os.path.expanduser(path)):
                print(f"error: no such file: {path}", file=sys.stderr)
            else:
                pending.append(os.path.expanduser(path))
                print(f"(image {len(pending)} attached to your next message: {path})",
                      file=sys.stderr)
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]!r}; {CHAT_HELP}", file=sys.stderr)
            continue
        if not line:
            continue
        content = [{"type": "image", "image": p} for p in pending] + \
            [{"type": "text", "text": line}] if pending else line
        turn = {"role": "user", "content": content}
        pending = []
        try:
            prompt = engine.chat_prompt(history + [turn], mm_processor_kwargs=image_kwargs,
                                        chat_template_kwargs=thinking_kwargs(args))
            request_id = engine.add_request(prompt, params, lora_request=lora)
        except ValueError as e:  # unreadable image, history longer than --max-model-len, ...
            print(
                f"error: {name_flags(str(e), CLI_FLAGS)} (message not sent; /reset clears the "
                "history)",
                file=sys.stderr)
            continue
        answer = _stream_answer(engine, request_id)
        if answer is not None:
            history += [turn, {"role": "assistant", "content": answer}]



def add_thinking_arg(p) -> None:
    p.add_argument("--no-thinking", action="store_true",
                   help="a thinking model (Qwen3, Qwen3.5) answers without thinking: the chat "
                   "template's enable_thinking=False; its thinking is otherwise shown marked")


def add_parsers(sub) -> list:
    g = sub.add_parser(
        "generate", help="answer one prompt (optionally about images)",
        description=f"Answer one prompt. Default model: {TEXT_MODEL} without --image, "
                    f"{VISION_MODEL} "
        f"with --image ({VISION_MODEL} is the embedded toy model, which knows only "
        "drawn scenes of coloured shapes, unless the real weights are in the Hugging "
        "Face cache).")
    g.add_argument("prompt")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for the prompt (repeatable; they come before the text)")
    g.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the chat template (write one "
                        "<|vision_start|><|image_pad|><|vision_end|> per --image yourself)")
    add_max_pixels(g)
    add_thinking_arg(g)
    add_lora_arg(g)
    add_model_args(g, f"{TEXT_MODEL}, or {VISION_MODEL} with --image")
    add_sampling_args(g, ANSWER_MAX_TOKENS)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "chat", help="interactive chat with streamed answers (/image PATH for vision models)",
        description=f"Interactive chat, answers streamed. {CHAT_HELP}. Default model: {TEXT_MODEL} "
        f"(text-only); pass --model {VISION_MODEL} to use /image.")
    add_max_pixels(c)
    add_thinking_arg(c)
    add_lora_arg(c)
    add_model_args(c, TEXT_MODEL)
    add_sampling_args(c, ANSWER_MAX_TOKENS, CHAT_TEMPERATURE, CHAT_TOP_P)
    c.set_defaults(func=cmd_chat)

    return [g, c]
