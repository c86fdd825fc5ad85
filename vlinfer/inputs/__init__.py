"""The data types requests carry between rooms (prompts, multimodal items, processed prompts) and
the one table of request limits every surface enforces. Nothing here imports another vlinfer room.
"""
import importlib

__all__ = ["MultiModalItem", "ProcessedPrompt", "PromptType"]


def __getattr__(name: str):
    """The data types on first use: the limits (limits.py) read without torch."""
    if name in __all__:
        return getattr(importlib.import_module("vlinfer.inputs.items"), name)
    raise AttributeError(f"module 'vlinfer.inputs' has no attribute {name!r}")
