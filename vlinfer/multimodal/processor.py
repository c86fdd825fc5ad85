"""Turns a Qwen3-VL request (token ids with one <|image_pad|> per image and one <|video_pad|> per
video, plus the images and videos) into what the engine runs: placeholders expanded to each image's
token count and each clip's timestamped groups, one MultiModalItem per image and per temporal group
with its preprocessed pixels and content hash, and the request's 3-row rotary positions."""
import hashlib
import torch

from vlinfer.inputs import MultiModalItem, ProcessedPrompt
from vlinfer.multimodal.image_io import ImageLoadError, image_content_hash, load_image
from vlinfer.multimodal.image_processor import Qwen3VLImageProcessor
from vlinfer.multimodal.mrope import mrope_positions
from vlinfer.multimodal.url_fetch import UrlPolicy
from vlinfer.inputs.limits import (MAX_IMAGES, MM_PROCESSOR_KWARGS, VIDEO_OPTIONS, too_many_images,
                                   unknown_mm_kwargs)
from vlinfer.multimodal.video_prompt import VideoPrompts


class Qwen3VLInputProcessor:
    def __init__(self, hf_config, tokenizer, folder: str, device: torch.device,
                 allow_image_urls: bool | UrlPolicy = False):
        self.tokenizer = tokenizer
        self.device = device
        self.url_policy = url_policy(allow_image_urls)
        self.image_processor = Qwen3VLImageProcessor.from_pretrained(folder)
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = getattr(hf_config, "video_token_id", None)
        self.vision_start_token_id = hf_config.vision_start_token_id
        self.vision_end_token_id = getattr(hf_config, "vision_end_token_id", None)
        self.spatial_merge_size = hf_config.vision_config.spatial_merge_size
        self.special_ids = {
            i
            for i in (self.image_token_id, self.video_token_id, self.vision_start_token_id,
                      self.vision_end_token_id) if i is not None
        }
        self.special_strings = [
            t for t in tokenizer.convert_ids_to_tokens(sorted(self.special_ids)) if t
        ]
        # Added tokens split the text before it is tokenized: a text run between two of them is
        # tokenized alone.
        self.added_token_ids = set(tokenizer.added_tokens_decoder)
        self.videos = VideoPrompts(hf_config, tokenizer, folder)

    def check_user_text(self, text: str) -> None:
        """Text from a user must not smuggle in vision tokens: only real images may create
        placeholders."""
        found = [s for s in self.special_strings if s in text]
        if found:
            raise ValueError(
                f"text contains the special vision token(s) {found}; pass images as image content "
                "parts or multi_modal_data instead of writing their tokens")

    def process(self, token_ids: list[int], images: list, mm_kwargs: dict | None = None,
                videos: list | None = None, keep_last: int | None = None) -> ProcessedPrompt:
        """Expand every <|image_pad|> to its image's tokens and every <|video_pad|> to its clip's
        (see vlinfer/multimodal/video_prompt.py), in prompt order, with one MultiModalItem per image
        and per temporal group of a clip. keep_last=k keeps the last k tokens of the expanded prompt
        (truncate_prompt_tokens); only text before the first image or clip may be cut. Each image
        and clip is decoded and preprocessed once."""
        videos = list(videos or [])
        num_placeholders = token_ids.count(self.image_token_id)
        if num_placeholders != len(images):
            raise ValueError(
                f"the prompt has {num_placeholders} <|image_pad|> placeholder(s) but {len(images)} "
                "image(s) were given; write one <|vision_start|><|image_pad|><|vision_end|> per "
                "image"
            )
        num_video_placeholders = token_ids.count(
            self.video_token_id) if self.video_token_id is not None else 0
        if num_video_placeholders != len(videos):
            raise ValueError(
                f"the prompt has {num_video_placeholders} <|video_pad|> placeholder(s) but "
                f"{len(videos)} video(s) were given; write one "
                "<|vision_start|><|video_pad|><|vision_end|> per video")
        if not images and not videos:
            return ProcessedPrompt(
                list(token_ids) if keep_last is None else list(token_ids)[-keep_last:])
        if len(images) + len(videos) > MAX_IMAGES:
            raise ValueError(too_many_images(len(images) + len(videos)))
        kwargs = dict(mm_kwargs or {})
        # detail: OpenAI's image detail ("low", "high", "auto"), one for all images or one per
        # image; chat image parts set it per image (image_url.detail). Video options: one value for
        # all videos or one per video.
        unknown = set(kwargs) - set(MM_PROCESSOR_KWARGS)
        if unknown:
            raise ValueError(unknown_mm_kwargs(unknown))
        video_kwargs = {k: kwargs.pop(k) for k in VIDEO_OPTIONS if k in kwargs}
        pil_images = []
        for i, image in enumerate(images):
            try:
                pil_images.append(load_image(image, url_policy=self.url_policy))
            except (ImageLoadError, TypeError) as e:
                raise ValueError(f"image {i}: {e}") from e
        processed = None
        if images:
            try:
                processed = self.image_processor(pil_images, device=self.device, **kwargs)
            except ValueError as e:
                raise ValueError(f"image preprocessing failed: {e}") from e
        clips = self.videos.load(videos, video_kwargs, self.url_policy, self.device)
        prompt = self._expand(token_ids, pil_images, processed, clips)
        cut = 0 if keep_last is None else len(prompt.token_ids) - keep_last
        if cut <= 0:
            return prompt
        first = prompt.first_mm_token if prompt.first_mm_token is not None else len(
            prompt.token_ids)
        if cut > first:
            raise ValueError(
                f"truncate_prompt_tokens={keep_last} (the last {keep_last} of "
                f"{len(prompt.token_ids)} "
                f"prompt tokens) cuts into image 0 (its placeholders start at token {first}); keep "
                "at "
                f"least {len(prompt.token_ids) - first}")
        # All that is cut is text before the first image, where the expanded and the unexpanded
        # prompt agree: expanding the cut prompt again recomputes placeholder offsets and rotary
        # positions, from the same pixels.
        return self._expand(token_ids[cut:], pil_images, processed, clips)

    def _expand(self, token_ids: list[int], pil_images: list, processed,
                clips: list) -> ProcessedPrompt:
        """The prompt with every placeholder expanded over the already preprocessed images and
        clips."""
        expanded, items, grids, offset_patch = [], [], [], 0
        image_index = video_index = 0
        first_mm_token = None
        skip_vision_end = False
        for i, token in enumerate(token_ids):
            if skip_vision_end:
                skip_vision_end = False
                continue
            if token == self.video_token_id:
                # Each temporal group carries its own vision_start / vision_end, so a clip replaces
                # the template's whole <|vision_start|><|video_pad|><|vision_end|> (video_prompt.py,
                # "The outer pair").
                text_before = []
                if expanded and expanded[-1] == self.vision_start_token_id and \
                        token_ids[i + 1:i + 2] == [self.vision_end_token_id]:
                    expanded.pop()
                    skip_vision_end = True
                    # Without the pair, the text before the clip runs on into its first timestamp
                    # and the two are tokenized as one ("below. <0.3" gives " <", not " ", "<"), as
                    # transformers tokenizes them.
                    start = len(expanded)
                    while start and expanded[start - 1] not in self.added_token_ids:
                        start -= 1
                    text_before = expanded[start:]
                    del expanded[start:]
                first_mm_token = len(expanded) if first_mm_token is None else first_mm_token
                grids.extend(self.videos.expand(clips[video_index], expanded, items, text_before))
                video_index += 1
                continue
            if token != self.image_token_id:
                expanded.append(token)
                continue
            first_mm_token = len(expanded) if first_mm_token is None else first_mm_token
            n = processed.num_tokens[image_index]
            t, h, w = processed.grid_thw[image_index].tolist()
            patches = processed.pixel_values[offset_patch:offset_patch + t * h * w]
            offset_patch += t * h * w
            # The same pixels resized differently encode differently: the key covers both.
            key = _combine(image_content_hash(pil_images[image_index]),
                           *processed.sizes[image_index])
            items.append(
                MultiModalItem(
                    "image", len(expanded), n, key,
                    {"pixel_values": patches, "grid_thw": processed.grid_thw[image_index]}))
            grids.append((t, h, w))
            expanded.extend([self.image_token_id] * n)
            image_index += 1
        # A clip's temporal groups are positioned as images of one frame pair each (transformers'
        # get_rope_index splits video_grid_thw per group the same way): every vision placeholder run
        # is one grid, in order.
        markers = [self.image_token_id if t == self.video_token_id else t for t in expanded]
        positions, delta = mrope_positions(markers, grids, self.image_token_id,
                                           self.vision_start_token_id, self.spatial_merge_size)
        info = [] if processed is None else \
            [{"size": list(size), "num_tokens": n}
             for size, n in zip(processed.sizes, processed.num_tokens)]
        return ProcessedPrompt(expanded, items, positions, delta, info,
                               [clip.info for clip in clips], first_mm_token)


def url_policy(allow_image_urls: bool | UrlPolicy) -> UrlPolicy | None:
    """LLM(allow_image_urls=...) -> how image URLs are fetched: True takes UrlPolicy's defaults, the
    server's checks with any public host allowed; None: URLs are refused."""
    if isinstance(allow_image_urls, UrlPolicy):
        return allow_image_urls
    if not isinstance(allow_image_urls, bool):
        raise ValueError(
            f"allow_image_urls must be True, False or a vlinfer.multimodal.UrlPolicy, got "
            f"{allow_image_urls!r}")
    return UrlPolicy() if allow_image_urls else None


def _combine(*keys: int) -> int:
    h = hashlib.blake2b(digest_size=8)
    for key in keys:
        h.update(int(key).to_bytes(17, "little", signed=True))
    # 63 bits: fits a signed int64 wherever it is stored
    return int.from_bytes(h.digest(), "little") >> 1
