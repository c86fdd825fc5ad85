"""`vlinfer caption`: a folder / glob / list of images and clips into a JSONL file, here or on a Ray
cluster."""
import sys

from vlinfer.cli.options import add_json_whitespace_arg, engine_options
from vlinfer.cli.shared import (VISION_MODEL, add_batch_job_args, add_lora_arg, add_max_pixels,
                                add_model_args, add_sampling_args, build_llm, lora_request,
                                sampling_params)
from vlinfer.config import CAPTION_MAX_TOKENS


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
        if args.lora is not None:
            raise ValueError("--lora is not supported with --ray yet; run without --ray")
        return _caption_on_ray(args)
    from vlinfer.captioning import caption_files, collect_images
    from vlinfer.captioning.captioner import check_caption_output
    # fail on bad inputs / output before loading the model
    paths = collect_images(args.inputs, videos=True)
    check_caption_output(args.out, args.resume, args.overwrite)
    model = args.model or VISION_MODEL
    llm = build_llm(args, model)
    summary = caption_files(llm, paths, args.out, prompt=args.prompt, batch_size=args.batch_size,
                            sampling_params=sampling_params(args), max_pixels=args.max_pixels,
                            resume=args.resume, overwrite=args.overwrite,
                            progress=not args.no_progress, json_schema=schema,
                            video_prompt=args.video_prompt, video_options=_video_options(args),
                            lora_request=lora_request(args),
                            disable_any_whitespace=args.structured_outputs_disable_any_whitespace)
    print(summary.line())
    if llm.engine.source.embedded:
        print(
            f"note: {model!r} ran {llm.engine.source.about}; "
            "fetch real weights with: huggingface-cli download Qwen/Qwen3-VL-2B-Instruct",
            file=sys.stderr)
    return 1 if summary.errors or summary.previous_errors else 0


def _video_options(args) -> dict:
    """--fps / --num-frames / --max-frames / --video-max-pixels: the video processor's keys, for
    every clip."""
    names = {"fps": args.fps, "num_frames": args.num_frames, "max_frames": args.max_frames,
             "video_max_pixels": args.video_max_pixels}
    return {k: v for k, v in names.items() if v is not None}


def _caption_on_ray(args) -> int:
    from vlinfer.integrations import MissingDependencyError
    try:
        from vlinfer.integrations.ray_caption import caption_on_ray
        model = args.model or VISION_MODEL
        summary = caption_on_ray(
            args.inputs, args.out, model=model, engine_options=engine_options(args),
            prompt=args.prompt, sampling=dict(temperature=args.temperature, top_p=args.top_p,
                                              max_tokens=args.max_tokens,
                                              seed=args.seed), batch_size=args.batch_size,
            max_pixels=args.max_pixels, resume=args.resume, overwrite=args.overwrite,
            replicas=args.replicas, address=args.ray or None, progress=not args.no_progress)
    except MissingDependencyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.line())
    return 1 if summary.errors or summary.previous_errors else 0



def add_parser(sub):
    k = sub.add_parser(
        "caption", help="caption a folder / glob / list of images into a JSONL file",
        description="Caption images in batches, one JSON line per image: {path, caption, tokens, "
        "size [h, w] as the model saw it, num_image_tokens, error}. Lines are written "
        "and fsync'ed batch by batch; --resume continues an interrupted run, skipping "
        "every path already recorded (captions and errors). Unreadable images are "
        "recorded with their error and the run goes on (exit code 1 at the end).")
    k.add_argument(
        "inputs", nargs="+", metavar="DIR_OR_GLOB_OR_PATH",
        help="a folder (its image files, sorted), a quoted glob ('photos/**/*.jpg'), image paths, "
             "or "
        "a .txt file listing one path per line; with --ray also Parquet/JSONL/CSV tables with a "
        "'path' column (and optional 'prompt', 'sampling' columns)")
    k.add_argument(
        "--out", required=True, help=
        "output JSONL file, e.g. captions.jsonl (with --ray also a folder ending in .parquet: one "
        "part file per batch)")
    k.add_argument("--prompt", default="Describe this image.",
                   help="default: 'Describe this image.'")
    add_batch_job_args(k, 8, "images")
    k.add_argument(
        "--json-schema", metavar="FILE", default=None,
        help="a JSON schema file: every caption is generated under it (structured outputs) and its "
        "record's caption is the parsed JSON value")
    add_json_whitespace_arg(k)
    add_max_pixels(k)
    add_lora_arg(k)
    v = k.add_argument_group(
        "videos", "video files (.mp4, .webm, .mkv, .mov, .avi, ...) in the inputs are "
        "captioned as clips: frames sampled at --fps (default: the model's, 2 for Qwen3-VL)")
    v.add_argument(
        "--video-prompt", default=None,
        help="the question for clips (default: --prompt when given, else 'Describe this video.')")
    v.add_argument("--fps", type=float, default=None, help="frames sampled per second of video")
    v.add_argument("--num-frames", type=int, default=None,
                   help="sample exactly N frames per clip (not with --fps)")
    v.add_argument("--max-frames", type=int, default=None,
                   help="at most N frames per clip (default: 768)")
    v.add_argument("--video-max-pixels", type=int, default=None, metavar="N",
                   help="pixel budget over a clip's sampled frames (frames x height x width)")
    add_model_args(k, VISION_MODEL)
    add_sampling_args(k, CAPTION_MAX_TOKENS)
    k.set_defaults(func=cmd_caption)

    return k
