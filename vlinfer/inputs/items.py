"""What a request carries into the engine, below every room that uses it: the prompt forms
LLM.generate accepts, a multimodal item (one image, or one temporal group of a video, in the token
stream), and a processed prompt (the multimodal processor's output: expanded token ids, items,
rotary positions)."""
from dataclasses import dataclass, field

import torch

# A prompt: text, token ids, or a dict {"prompt" | "prompt_token_ids", "multi_modal_data",
# "mm_processor_kwargs"}.
PromptType = str | list[int] | dict


@dataclass
class MultiModalItem:
    """One image, or one temporal group (frame pair) of a video, in a prompt: the placeholder run it
    fills and what the encoder needs."""
    modality: str
    offset: int  # index of its first placeholder token in token_ids
    length: int  # number of placeholder tokens it expands to
    # identifies the pixels: keys the encoder cache and folds into prefix-cache block hashes
    content_hash: int
    data: dict = field(default_factory=dict)  # encoder inputs, e.g. pixel_values and grid_thw

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    mm_items: list[MultiModalItem] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: int = 0
    # per image: effective (resized) size and token count
    images: list[dict] = field(default_factory=list)
    # per video: frames used, their times, size, grid, tokens
    videos: list[dict] = field(default_factory=list)
    # index of the first token an image or video placeholder expanded to
    first_mm_token: int | None = None
