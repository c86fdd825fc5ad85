"""Command line: `python -m vlinfer generate|chat ...` (also installed as `vlinfer`)."""
import argparse
import logging
import sys

DEFAULT_MODEL = "smollm2"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"alias, local folder, .gguf file or Hugging Face repo id (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None)


def _llm(args):
    from vlinfer import LLM
    return LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)


def _params(args):
    from vlinfer import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)


def cmd_generate(args) -> int:
    llm = _llm(args)
    if args.raw:
        out = llm.generate(args.prompt, _params(args), use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], _params(args), use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def cmd_chat(args) -> int:
    llm = _llm(args)
    engine = llm.engine
    history = []
    print(f"chatting with {args.model}; /exit to quit, /reset to clear the history", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        text = llm.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = llm.tokenizer(text, add_special_tokens=False).input_ids
        request_id = engine.add_request({"prompt": text, "prompt_token_ids": ids}, _params(args))
        answer = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    print(out.outputs[0].delta_text, end="", flush=True)
                    answer = out.outputs[0].text
        print()
        history.append({"role": "assistant", "content": answer})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vlinfer", description="vlinfer: small VLM / LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer one prompt")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with streamed answers")
    _add_engine_args(c)
    c.set_defaults(func=cmd_chat)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
