"""A Qwen3-VL prompt's videos: load and preprocess each clip, then expand its <|video_pad|> into the
tokens transformers' Qwen3VLProcessor writes for it, with one MultiModalItem per temporal group.

Each temporal group g (two frames) becomes `<{t_g:.1f} seconds><|vision_start|><|video_pad|> *
n<|vision_end|>`, n = grid_h * grid_w / merge^2, the timestamp plain text. For the vision tower and
the positions a group is an image of one frame pair: transformers encodes a clip with attention
inside each group only (cu_seqlens per frame pair) and the same 2-D positions for every group, and
its get_rope_index splits video_grid_thw into (1, h, w) per group; so a group as its own item
encodes, caches, chunks and positions exactly as the clip would.

The outer pair: the chat template writes `<|vision_start|><|video_pad|><|vision_end|>`, and the
clip's expansion replaces the whole triple (multimodal/processor.py), since every group carries its
own pair. transformers 5.25 (the version this project checks against, pinned as the floor in
pyproject.toml), 4.57 and vLLM do the same; 5.0 to 5.24 replaced only the <|video_pad|> and kept the
template's pair around the expansion, two tokens more.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, is_dataclass, replace

import torch

from vlinfer.inputs import MultiModalItem
from vlinfer.multimodal.video_io import VideoLimits, VideoLoadError, load_video
from vlinfer.multimodal.video_processor import (VIDEO_OPTIONS, ProcessedVideo,
                                                Qwen3VLVideoProcessor, VideoOptions)


@dataclass
class Clip:
    video: ProcessedVideo
    timestamp_ids: list[list[int]]  # tokens of each group's "<t seconds>"
    info: dict                      # echoed back to the caller


class VideoPrompts:
    def __init__(self, hf_config, tokenizer, folder: str, limits: VideoLimits | None = None):
        self.tokenizer = tokenizer
        self.processor = Qwen3VLVideoProcessor.from_pretrained(folder)
        self.limits = limits or VideoLimits()
        self.video_token_id = hf_config.video_token_id
        self.vision_start_token_id = hf_config.vision_start_token_id
        self.vision_end_token_id = hf_config.vision_end_token_id
        self.merge = hf_config.vision_config.spatial_merge_size
        self._timestamp_cache: dict[str, list[int]] = {}

    def options(self, video_kwargs: dict, n: int) -> list[VideoOptions]:
        """mm_processor_kwargs' video keys -> one VideoOptions per video (a list value gives one per
        video)."""
        per_video = [{} for _ in range(n)]
        for key, value in video_kwargs.items():
            values = value if isinstance(value, (list, tuple)) else [value] * n
            if len(values) != n:
                raise ValueError(
                    f"mm_processor_kwargs.{key} has {len(values)} entries for {n} videos")
            for d, v in zip(per_video, values):
                if v is not None:
                    d[key] = v
        return [VideoOptions.of(d) for d in per_video]

    def load(self, videos: list, video_kwargs: dict, url_policy, device) -> list[Clip]:
        if not videos:
            if video_kwargs:
                unused = sorted(video_kwargs)
                raise ValueError(
                    f"mm_processor_kwargs {unused} apply to videos, but the request has none")
            return []
        clips = []
        for i, (entry, opts) in enumerate(zip(videos, self.options(video_kwargs, len(videos)))):
            source, metadata = _split_entry(entry)
            try:
                plan = self._capped(self.processor.plan(self._clamped(opts)))
                loaded = load_video(source, plan, self.processor.resize, metadata=metadata,
                                    url_policy=url_policy, limits=self.limits)
                video = self.processor(loaded, opts, device=device)
            except (VideoLoadError, ValueError, TypeError) as e:
                raise ValueError(f"video {i}: {e}") from e
            ids = [self._timestamp(t) for t in video.timestamps]
            n = video.tokens_per_group
            info = {
                "num_frames": len(video.frames_indices), "frames_indices": video.frames_indices,
                "fps": video.fps, "duration": loaded.source.duration,
                "timestamps": video.timestamps, "size": list(video.size),
                "grid_thw": list(video.grid_thw), "num_tokens": sum(len(t) + 2 + n for t in ids),
                "num_video_tokens": n * video.grid_thw[0]
            }
            clips.append(Clip(video, ids, info))
        return clips

    def _clamped(self, opts: VideoOptions) -> VideoOptions:
        """limits.max_frames: sampling clamps to it (a lower max_frames); asking for more is an
        error."""
        cap = self.limits.max_frames
        if cap is None:
            return opts
        for name in ("num_frames", "max_frames"):
            value = getattr(opts, name)
            if value is not None and value > cap:
                raise ValueError(f"{name}={value} is over the limit of {cap} frames per video")
        if (opts.max_frames or self.processor.max_frames) <= cap:
            return opts
        return replace(opts, max_frames=cap)

    def _capped(self, plan):
        """A plan that refuses more than limits.max_frames frames (a list of frames kept as given
        can have more)."""
        cap = self.limits.max_frames
        if cap is None:
            return plan

        def capped(source):
            indices, size = plan(source)
            if len(indices) > cap:
                raise VideoLoadError(
                    f"the video has {len(indices)} frames to encode, over the limit of {cap} "
                    "frames per video")
            return indices, size
        return capped

    def expand(self, clip: Clip, expanded: list[int], items: list[MultiModalItem],
               text_before: list[int] | None = None) -> list[tuple[int, int, int]]:
        """Append the clip's tokens to `expanded` and one item per temporal group to `items`;
        returns the groups' (1, h, w) grids for the positions. text_before: the text tokens just
        before the clip with no added token between, tokenized again together with the first
        timestamp."""
        video = clip.video
        gt, gh, gw = video.grid_thw
        rows = gh * gw
        n = rows // (self.merge * self.merge)
        grid = torch.tensor([1, gh, gw], dtype=torch.long)
        for g in range(gt):
            if g == 0 and text_before:
                text = self.tokenizer.decode(text_before) + self.tokenizer.decode(
                    clip.timestamp_ids[0])
                expanded.extend(self.tokenizer.encode(text, add_special_tokens=False))
            else:
                expanded.extend(clip.timestamp_ids[g])
            expanded.append(self.vision_start_token_id)
            items.append(
                MultiModalItem(
                    "video", len(expanded), n, _group_key(video.content_hash, g),
                    {"pixel_values": video.pixel_values[g * rows:(g + 1) * rows], "grid_thw": grid
                     }))
            expanded.extend([self.video_token_id] * n)
            expanded.append(self.vision_end_token_id)
        return [(1, gh, gw)] * gt

    def _timestamp(self, seconds: float) -> list[int]:
        # Special tokens on both sides (vision_start before, vision_end / vision_start after) cut
        # the text there, so tokenizing it alone gives the ids transformers gets from the whole
        # expanded string.
        text = f"<{seconds:.1f} seconds>"
        ids = self._timestamp_cache.get(text)
        if ids is None:
            ids = self._timestamp_cache[text] = self.tokenizer.encode(text,
                                                                      add_special_tokens=False)
        return ids


def _split_entry(entry):
    """A video, or vLLM's (frames, metadata) pair; metadata a dict or transformers' VideoMetadata.
    """
    if isinstance(entry, tuple):
        if len(entry) != 2:
            raise ValueError(f"a video tuple must be (frames, metadata), got {len(entry)} entries")
        source, metadata = entry
        if is_dataclass(metadata):
            metadata = asdict(metadata)
        if not isinstance(metadata, dict):
            raise ValueError(f"video metadata must be a dict, got {type(metadata).__name__}")
        # transformers' VideoMetadata carries every field, unset ones as None.
        return source, {k: v for k, v in metadata.items() if v is not None}
    return entry, None


def _group_key(clip_hash: int, group: int) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(clip_hash.to_bytes(8, "little"))
    h.update(group.to_bytes(4, "little"))
    return int.from_bytes(h.digest(), "little") >> 1


__all__ = ["Clip", "VideoPrompts", "VIDEO_OPTIONS"]
