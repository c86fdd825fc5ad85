"""OpenAI-compatible HTTP server around one EngineLoop (`python -m vlinfer serve --model qwen3-vl`,
vlinfer/cli/serve.py). app.py builds the app; routes/ holds one module per route family (chat,
completions, pooling, admin); protocol.py every request model.

FastAPI and uvicorn are imported only when the server is used, so `vlinfer` itself never needs
them."""
__all__ = ["ImagePolicy", "ServeConfig", "build_app"]
_LAZY = {
    "ServeConfig": "vlinfer.serve.config", "build_app": "vlinfer.serve.app",
    "ImagePolicy": "vlinfer.serve.security"
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlinfer.serve' has no attribute {name!r}")
