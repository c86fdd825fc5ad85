"""`vlinfer serve ...`: flags -> ServeConfig and engine options, then uvicorn around build_app, or
replicas on Ray Serve (--ray)."""
import argparse
import json
import logging
import os
import signal
import socket
import sys

# Only what the flags show is imported here (no torch, FastAPI or engine): serve --help is instant.
from vlinfer.cli.options import (add_engine_args, add_json_whitespace_arg, advanced_group,
                                 compact_usage, engine_options, flags_in_logs, json_object,
                                 name_flags, parse_size, set_threads)
from vlinfer.inputs.limits import MAX_IMAGE_PIXELS, MAX_IMAGES
from vlinfer.serve.limits import (MAX_IMAGE_BYTES, MAX_VIDEO_BYTES, MAX_VIDEO_FRAMES,
                                  MAX_VIDEO_SECONDS, RUNTIME_FLAG)

logger = logging.getLogger("vlinfer.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlinfer serve", description="OpenAI-compatible HTTP server "
        "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)")
    p.add_argument(
        "--model", default="qwen3-vl",
        help="alias, local folder, .gguf file or Hugging Face repo id "
        "(default: qwen3-vl; without its weights on this machine, the embedded toy model, which "
        "knows only drawn scenes)")
    p.add_argument(
        "--chat-template", default=None, metavar="FILE",
        help="a Jinja chat template file to render chat requests with, as vLLM's (default: the "
        "model's own); one that reads `tools` for tool calling")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use in 'model' (default: --model); repeatable")
    p.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(default: $VLINFER_API_KEY; none when unset)")
    advanced = advanced_group(p)
    add_engine_args(advanced)
    advanced.add_argument(
        "--lora-modules", nargs="+", action="extend", type=lora_module, default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served from the start, chosen by the request's 'model': "
        "name=path, or vLLM's JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
        "(turns --enable-lora on; docs/lora.md)")
    advanced.add_argument(
        RUNTIME_FLAG, action="store_true",
        help="let clients load and unload LoRA adapters by path (POST /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING). Off by default: "
        "whoever "
        "can call the server could then read adapter folders on this machine")
    advanced.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="serve --replicas engines with Ray Serve behind this one endpoint: ADDRESS of the Ray "
        "cluster's head ('auto': the one this machine is in), or none to start one here "
        "(needs pip install 'vlinfer[ray]')")
    advanced.add_argument("--replicas", type=int, default=1,
                   help="with --ray: engine replicas (default: 1)")
    advanced.add_argument("--max-request-bytes", type=parse_size, default=32 * 2 ** 20,
                          metavar="SIZE",
                   help="largest request body (413 past it); default 32M")
    advanced.add_argument("--max-image-bytes", type=parse_size,
                   default=MAX_IMAGE_BYTES, metavar="SIZE", help="default 20M")
    advanced.add_argument("--max-video-bytes", type=parse_size,
                   default=MAX_VIDEO_BYTES, metavar="SIZE",
                   help="one video (data URI, file or http(s) URL); default 256M")
    advanced.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                   help="per image, width x height; default 2^25 (vlinfer/inputs/limits.py)")
    advanced.add_argument("--max-images-per-request", type=int, default=MAX_IMAGES,
                   help="images and videos in one request; default 16 (vlinfer/inputs/limits.py)")
    advanced.add_argument(
        "--max-video-frames", type=int, default=MAX_VIDEO_FRAMES, metavar="N",
        help="most frames sampled from one video (sampling clamps to it; a request asking for more "
        "gets 400); default 768, the Qwen3-VL video processor's max_frames")
    advanced.add_argument(
        "--max-video-seconds", type=float, default=MAX_VIDEO_SECONDS, metavar="S",
        help="longest video accepted, by its container's duration (400 past it); default 3600")
    advanced.add_argument("--max-n", type=int, default=16,
                          help="most sequences per request (n x prompts)")
    advanced.add_argument("--max-pending", type=int, default=1024,
                          help="sequences in flight before 503")
    advanced.add_argument(
        "--max-tokens-default", type=int, default=None, metavar="N",
        help="max_tokens of a request that gives none (default: the rest of the context, "
        "vLLM's rule)")
    advanced.add_argument(
        "--request-timeout", type=float, default=None, metavar="S",
        help="seconds one request may take from arrival; a sequence still generating then ends "
        "with finish_reason 'length', and the log says so (default: no limit)")
    advanced.add_argument("--image-formats", default="png,jpeg,webp,gif,bmp", metavar="FORMATS",
                   help="image formats accepted (PIL names); default: png,jpeg,webp,gif,bmp")
    advanced.add_argument(
        "--allowed-url-hosts", default="", metavar="HOSTS",
        help="comma-separated hosts image URLs may point to ('*.example.com' for subdomains, '*' "
             "for "
        "any public host); default: none, image URLs refused")
    advanced.add_argument(
        "--allow-private-urls", action="store_true", help=
        "let image URLs reach loopback / private / link-local addresses (only for trusted setups)")
    advanced.add_argument("--url-timeout", type=float, default=10.0,
                   help="seconds per image URL, redirects included")
    advanced.add_argument(
        "--allowed-local-root", default=None, metavar="DIR",
        help="serve file:// image URLs from below this folder only; default: file URLs refused")
    add_json_whitespace_arg(advanced)
    advanced.add_argument(
        "--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
        help="chat template variables every chat request gets, a request's chat_template_kwargs "
        "over them (vLLM's), e.g. '{\"enable_thinking\": false}' (docs/reasoning.md)")
    advanced.add_argument(
        "--malloc-arena-max", type=int, default=2,
        help="glibc malloc arenas, so RSS comes back after bursts (0: glibc's default); default 2")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log everything: the same as --log-level debug")
    p.usage = compact_usage(p)
    return p


def lora_module(text: str):
    """One --lora-modules item, in either of vLLM's forms: name=path, or JSON with name, path and
    optionally base_model_name (the served model name /v1/models gives as its parent)."""
    from vlinfer.serve.config import LoRAModule
    if not text.lstrip().startswith("{"):
        name, equals, path = text.partition("=")
        if not (equals and name and path):
            raise argparse.ArgumentTypeError(f"{text!r} is neither name=path nor JSON "
                                             '{"name": ..., "path": ..., "base_model_name": ...}')
        return LoRAModule(name, path)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {e}") from None
    keys = set(fields) if isinstance(fields, dict) else set()
    if not isinstance(fields, dict) or \
            not {"name", "path"} <= keys <= {"name", "path", "base_model_name"} or \
            not all(isinstance(v, str) and v for v in fields.values()):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the JSON form is an object of strings: name, path and "
            "optionally base_model_name")
    return LoRAModule(**fields)


def port_in_use(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on (the OS's words), or None when it can: bound and closed
    again here, with uvicorn's SO_REUSEADDR, so a port left in TIME_WAIT still counts as free."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        return e.strerror or str(e)
    return None


def url_hosts(args) -> tuple[str, ...]:
    """The server fetches image URLs itself: --allow-image-urls (the engine flag every app takes)
    means any public host, as LLM(allow_image_urls=True) does; --allowed-url-hosts names them one by
    one."""
    hosts = tuple(h for h in args.allowed_url_hosts.split(",") if h)
    return hosts or (("*",) if args.allow_image_urls else ())


def chat_template(path: str | None) -> str | None:
    """--chat-template FILE's text, checked to parse as Jinja before the model loads."""
    if path is None:
        return None
    import jinja2
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        jinja2.Environment().parse(text)
    except OSError as e:
        raise ValueError(f"--chat-template {path!r} cannot be read: {e.strerror or e}") from None
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {path!r} is not a Jinja template: {e}") from None
    return text


def config_from_args(args):
    """The ServeConfig of the flags."""
    from vlinfer.multimodal.video_io import VideoLimits
    from vlinfer.serve import security
    from vlinfer.serve.config import ServeConfig
    images = security.ImagePolicy(
        max_image_bytes=args.max_image_bytes, max_video_bytes=args.max_video_bytes,
        max_image_pixels=args.max_image_pixels, max_images=args.max_images_per_request,
        allowed_url_hosts=url_hosts(args), allow_private_urls=args.allow_private_urls,
        url_timeout=args.url_timeout, allowed_local_root=args.allowed_local_root,
        image_formats=tuple(args.image_formats.split(",")))
    for flag, value in (("--max-video-frames", args.max_video_frames), ("--max-video-seconds",
                                                                        args.max_video_seconds)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    for flag, value in (("--max-tokens-default", args.max_tokens_default),
                        ("--request-timeout", args.request_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    video = VideoLimits(max_frames=args.max_video_frames, max_seconds=args.max_video_seconds)
    return ServeConfig(served_model_names=tuple(args.served_model_name or [args.model]),
                       chat_template=chat_template(args.chat_template),
                       api_key=args.api_key or os.environ.get("VLINFER_API_KEY") or None,
                       max_body_bytes=args.max_request_bytes, images=images, max_n=args.max_n,
                       max_pending=args.max_pending,
                       disable_any_whitespace=args.structured_outputs_disable_any_whitespace,
                       video=video, lora_modules=tuple(args.lora_modules),
                       allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                       max_tokens_default=args.max_tokens_default,
                       request_timeout_s=args.request_timeout,
                       default_chat_template_kwargs=args.default_chat_template_kwargs)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:  # imported only now: the flags and --help need neither
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"error: the server needs FastAPI, uvicorn, httpx and prometheus_client ({e.name} "
              "is missing): pip install 'vlinfer[serve]'", file=sys.stderr)
        return 2
    from vlinfer.engine import LLMEngine
    from vlinfer.serve.memory import limit_malloc_arenas
    if args.verbose:
        args.log_level = "debug"
    limit_malloc_arenas(args.malloc_arena_max)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except FileNotFoundError as e:
        print(f"error: --allowed-local-root: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # an unknown --image-formats name
        print(f"error: {e}", file=sys.stderr)
        return 2
    busy = port_in_use(args.host, args.port)
    if busy:  # said before the model loads, not after
        print(f"error: --port {args.port} on {args.host} cannot be used ({busy}); another "
              "server may hold it: stop it or pick another --port", file=sys.stderr)
        return 2
    if config.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "listening on %s without an API key: anyone who can reach this port can use the model",
            args.host)
    if config.allow_runtime_lora_updating:
        logger.warning("%s: clients may load LoRA adapters from any folder this server can read",
                       RUNTIME_FLAG)
    if args.ray is not None:
        if config.allow_runtime_lora_updating:  # a load would reach one replica, not all
            print(
                f"error: {RUNTIME_FLAG} is not supported with --ray; give the adapters with "
                "--lora-modules",
                file=sys.stderr)
            return 2
        return _serve_on_ray(args, config)
    # the engine's messages name the flags set here (--max-model-len, --kv-cache-size)
    with flags_in_logs():
        try:
            set_threads(args)
            engine = LLMEngine(args.model, **engine_options(args))
            return _serve(engine, args, config)
        # a mistyped --device, a KV budget too small, no model, a
        except (ValueError, FileNotFoundError) as e:
            # --lora-modules adapter that cannot run
            print(f"error: {name_flags(str(e))}", file=sys.stderr)
            return 2


def _serve_on_ray(args, config) -> int:
    from vlinfer.integrations import MissingDependencyError
    if args.replicas < 1:
        print(f"error: --replicas must be >= 1, got {args.replicas}", file=sys.stderr)
        return 2
    try:
        from vlinfer.integrations import ray_serve
        return ray_serve.run(args.model, engine_options(args), config, args.replicas, args.host,
                             args.port, args.ray or None)
    except (MissingDependencyError, ValueError, FileNotFoundError) as e:
        print(f"error: {name_flags(str(e))}", file=sys.stderr)
        return 2


def _serve(engine, args, config) -> int:
    import uvicorn

    from vlinfer.engine.engine_loop import EngineLoop
    from vlinfer.serve.app import build_app
    loop = EngineLoop(engine)
    try:
        # reads and checks the --lora-modules adapters: ValueError naming one
        app = build_app(loop, config)
        # uvicorn shuts down gracefully on SIGTERM, then raises it again: exit through the finally
        # below (engine loop stopped, tensor-parallel workers closed) instead of dying on the
        # default handler.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5, server_header=False)
    except KeyboardInterrupt:  # likewise for Ctrl-C
        pass
    finally:
        loop.close()
        engine.close()
    return 0
