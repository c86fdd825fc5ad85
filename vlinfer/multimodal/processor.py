"""Turns a Qwen3-VL request (token ids with one <|image_pad|> per image, plus the images) into what the engine
runs: placeholders expanded to each image's token count, one MultiModalItem per image with its preprocessed
pixels and content hash, and the request's 3-row rotary positions."""
import hashlib
import os
from dataclasses import dataclass, field

import torch

from vlinfer.engine.sequence import MultiModalItem
from vlinfer.multimodal.image_io import ImageLoadError, image_content_hash, load_image
from vlinfer.multimodal.image_processor import Qwen3VLImageProcessor
from vlinfer.multimodal.mrope import mrope_positions
from vlinfer.multimodal.url_fetch import UrlPolicy

MAX_IMAGES_PER_PROMPT = 64


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    mm_items: list[MultiModalItem] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: int = 0
    images: list[dict] = field(default_factory=list)  # per image: effective (resized) size and token count


class Qwen3VLInputProcessor:
    def __init__(self, hf_config, tokenizer, folder: str, device: torch.device,
                 allow_image_urls: bool | UrlPolicy = False):
        self.tokenizer = tokenizer
        self.device = device
        self.url_policy = url_policy(allow_image_urls)
        has_config = any(os.path.exists(os.path.join(folder, f))
                         for f in ("preprocessor_config.json", "processor_config.json"))
        # Without the checkpoint's file, the published Qwen3-VL values (the class defaults) apply.
        self.image_processor = Qwen3VLImageProcessor.from_pretrained(folder) if has_config else Qwen3VLImageProcessor()
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = getattr(hf_config, "video_token_id", None)
        self.vision_start_token_id = hf_config.vision_start_token_id
        self.vision_end_token_id = getattr(hf_config, "vision_end_token_id", None)
        self.spatial_merge_size = hf_config.vision_config.spatial_merge_size
        self.special_ids = {i for i in (self.image_token_id, self.video_token_id, self.vision_start_token_id,
                                        self.vision_end_token_id) if i is not None}
        self.special_strings = [t for t in tokenizer.convert_ids_to_tokens(sorted(self.special_ids)) if t]

    def check_user_text(self, text: str) -> None:
        """Text from a user must not smuggle in vision tokens: only real images may create placeholders."""
        found = [s for s in self.special_strings if s in text]
        if found:
            raise ValueError(f"text contains the special vision token(s) {found}; pass images as image content "
                             "parts or multi_modal_data instead of writing their tokens")

    def process(self, token_ids: list[int], images: list, mm_kwargs: dict | None = None) -> ProcessedPrompt:
        if self.video_token_id is not None and self.video_token_id in token_ids:
            raise ValueError("video inputs are not supported yet (the prompt contains <|video_pad|>)")
        num_placeholders = token_ids.count(self.image_token_id)
        if num_placeholders != len(images):
            raise ValueError(f"the prompt has {num_placeholders} <|image_pad|> placeholder(s) but {len(images)} "
                             "image(s) were given; write one <|vision_start|><|image_pad|><|vision_end|> per image")
        if not images:
            return ProcessedPrompt(list(token_ids))
        if len(images) > MAX_IMAGES_PER_PROMPT:
            raise ValueError(f"{len(images)} images in one prompt; the limit is {MAX_IMAGES_PER_PROMPT}")
        kwargs = dict(mm_kwargs or {})
        # detail: OpenAI's image detail ("low", "high", "auto"), one for all images or one per image; chat
        # image parts set it per image (image_url.detail).
        unknown = set(kwargs) - {"min_pixels", "max_pixels", "detail"}
        if unknown:
            raise ValueError(f"unknown mm_processor_kwargs {sorted(unknown)}; accepted: min_pixels, max_pixels, "
                             "detail")
        pil_images = []
        for i, image in enumerate(images):
            try:
                pil_images.append(load_image(image, url_policy=self.url_policy))
            except (ImageLoadError, TypeError) as e:
                raise ValueError(f"image {i}: {e}") from e
        try:
            processed = self.image_processor(pil_images, device=self.device, **kwargs)
        except ValueError as e:
            raise ValueError(f"image preprocessing failed: {e}") from e
        expanded, items, offset_patch = [], [], 0
        image_index = 0
        for token in token_ids:
            if token != self.image_token_id:
                expanded.append(token)
                continue
            n = processed.num_tokens[image_index]
            t, h, w = processed.grid_thw[image_index].tolist()
            patches = processed.pixel_values[offset_patch:offset_patch + t * h * w]
            offset_patch += t * h * w
            # The same pixels resized differently encode differently: the key covers both.
            key = _combine(image_content_hash(pil_images[image_index]), *processed.sizes[image_index])
            items.append(MultiModalItem("image", len(expanded), n, key,
                                        {"pixel_values": patches, "grid_thw": processed.grid_thw[image_index]}))
            expanded.extend([self.image_token_id] * n)
            image_index += 1
        positions, delta = mrope_positions(expanded, processed.grid_thw, self.image_token_id,
                                           self.vision_start_token_id, self.spatial_merge_size)
        info = [{"size": list(size), "num_tokens": n} for size, n in zip(processed.sizes, processed.num_tokens)]
        return ProcessedPrompt(expanded, items, positions, delta, info)


def url_policy(allow_image_urls: bool | UrlPolicy) -> UrlPolicy | None:
    """LLM(allow_image_urls=...) -> how image URLs are fetched: True takes UrlPolicy's defaults, the server's
    checks with any public host allowed; None: URLs are refused."""
    if isinstance(allow_image_urls, UrlPolicy):
        return allow_image_urls
    if not isinstance(allow_image_urls, bool):
        raise ValueError(f"allow_image_urls must be True, False or a vlinfer.multimodal.UrlPolicy, got "
                         f"{allow_image_urls!r}")
    return UrlPolicy() if allow_image_urls else None


def _combine(*keys: int) -> int:
    h = hashlib.blake2b(digest_size=8)
    for key in keys:
        h.update(int(key).to_bytes(17, "little", signed=True))
    return int.from_bytes(h.digest(), "little") >> 1  # 63 bits: fits a signed int64 wherever it is stored
