"""OpenAI-compatible HTTP server around one EngineLoop: `python -m vlinfer.serve --model qwen3-vl`.

FastAPI and uvicorn are imported only when the server is used, so `vlinfer` itself never needs them."""
import sys

__all__ = ["ImagePolicy", "ServeConfig", "build_app", "build_parser", "main"]
_LAZY = {"ServeConfig": "app", "build_app": "app", "build_parser": "cli", "ImagePolicy": "security"}


def main(argv=None) -> int:
    """`python -m vlinfer.serve ARGS` (or `vlinfer serve ARGS`); returns the exit code."""
    try:
        from vlinfer.serve.cli import main as run
    except ImportError as e:
        print(f"error: the server needs FastAPI, uvicorn, httpx and prometheus_client ({e.name} is missing): "
              "pip install fastapi uvicorn httpx prometheus_client", file=sys.stderr)
        return 2
    return run(argv)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"vlinfer.serve.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'vlinfer.serve' has no attribute {name!r}")
