"""The data types requests carry between rooms (prompts, multimodal items, processed prompts) and
the one table of request limits every surface enforces. Nothing here imports another vlinfer room.
"""
from vlinfer.inputs.items import MultiModalItem, ProcessedPrompt, PromptType

__all__ = ["MultiModalItem", "ProcessedPrompt", "PromptType"]
