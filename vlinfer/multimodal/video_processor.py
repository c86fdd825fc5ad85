"""Qwen3-VL video preprocessing: which frames, at what size, as which patch rows, with which
timestamps.

Reference: transformers' `Qwen3VLVideoProcessor` (models/qwen3_vl/video_processing_qwen3_vl.py) and
`Qwen3VLProcessor._calculate_timestamps`, step for step:
  - frames: n = int(total / source_fps * fps), clamped to [min_frames, max_frames] and to the clip,
    then
    linspace(0, total - 1, n).round(); or linspace over num_frames when that is given instead of
    fps;
  - size: the video smart_resize (32-pixel windows, min / max pixels over the whole clip, t_bar * h
    * w), optionally
    with the per-frame cap of qwen-vl-utils (cap_pixels_per_frame);
  - pixels: uint8 bicubic antialiased resize, fused rescale + normalize in float32, an odd frame
    count padded by
    repeating the last frame, patches ordered [group, merge window, in-window, (C, T, P, P)];
  - timestamps: the mean source time of each group's two frames, from the source fps and source
    indices.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.transforms.v2 import functional as tvF

from vlinfer.multimodal.processor_config import read_processor_config
from vlinfer.inputs.limits import VIDEO_OPTIONS  # the request keys, from the one table
from vlinfer.multimodal.image_processor import _PIL_TO_TV
from vlinfer.multimodal.video_io import LoadedVideo, VideoSource

# Keys a request may set per video (mm_processor_kwargs, or a video part's own keys).


def video_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL video smart_resize: the pixel budget covers the whole clip (t_bar * h
    * w)."""
    if num_frames < temporal_factor:
        raise ValueError(
            f"a video needs at least {temporal_factor} frames, got {num_frames} (send a single "
            "frame "
            "as an image)")
    if height <= 0 or width <= 0:
        raise ValueError(f"video frame size must be positive, got {height}x{width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"video frames {height}x{width} have an aspect ratio over the limit of 200")
    if max_pixels < factor * factor * temporal_factor:
        raise ValueError(f"video_max_pixels={max_pixels} is below one {factor}x{factor} window for "
                         f"{temporal_factor} frames")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class VideoOptions:
    """One video's sampling and sizing; None means the processor's (checkpoint's) value."""
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    cap_pixels_per_frame: bool | None = None
    do_sample_frames: bool | None = None

    @classmethod
    def of(cls, d: dict) -> "VideoOptions":
        unknown = set(d) - set(VIDEO_OPTIONS)
        if unknown:
            raise ValueError(
                f"unknown video options {sorted(unknown)}; accepted: {', '.join(VIDEO_OPTIONS)}")
        opts = cls(**d)
        if opts.fps is not None and opts.num_frames is not None:
            # transformers: "`num_frames` and `fps` are mutually exclusive arguments".
            raise ValueError("fps and num_frames are mutually exclusive; give one")
        for name in ("fps", "num_frames", "min_frames", "max_frames", "video_min_pixels",
                     "video_max_pixels"):
            value = getattr(opts, name)
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, (int, float)) or not value > 0 or
                                      (name != "fps" and int(value) != value)):
                raise ValueError(
                    f"{name} must be a positive {'number' if name == 'fps' else 'integer'}, "
                    f"got {value!r}")
        return opts

    def key(self) -> tuple:
        return tuple(getattr(self, name) for name in VIDEO_OPTIONS)


@dataclass
class ProcessedVideo:
    pixel_values: torch.Tensor   # float32 [grid_t * grid_h * grid_w, 3 * T * P * P]
    grid_thw: tuple[int, int, int]
    timestamps: list[float]      # seconds, one per temporal group
    frames_indices: list[int]    # source index of each sampled frame (before the odd-count pad)
    fps: float                   # source fps the timestamps use
    size: tuple[int, int]        # resized (h, w)
    content_hash: int            # sampled, resized frames + sampling options

    @property
    def tokens_per_group(self) -> int:
        return self.grid_thw[1] * self.grid_thw[2] // 4


class Qwen3VLVideoProcessor:
    def __init__(self, *, patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2,
                 image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                 min_pixels: int = 128 * 32 * 32, max_pixels: int = 768 * 32 * 32,
                 resample: int = 3, do_rescale: bool = True, rescale_factor: float = 1 / 255,
                 do_normalize: bool = True, fps: float = 2, num_frames=None, min_frames: int = 4,
                 max_frames: int = 768, do_sample_frames: bool = True,
                 cap_pixels_per_frame: bool = False, max_video_tokens: int = 768):
        # The defaults are transformers' class defaults, which apply when a checkpoint has no
        # video_preprocessor_config.json; the released checkpoints' file sets size 4096 / 25165824.
        if resample not in _PIL_TO_TV:
            raise ValueError(
                f"unsupported resample code {resample}; expected one of {sorted(_PIL_TO_TV)}")
        self.patch_size, self.temporal_patch_size, self.merge_size = \
            int(patch_size), int(temporal_patch_size), int(merge_size)
        self.image_mean = [float(v) for v in image_mean]
        self.image_std = [float(v) for v in image_std]
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        self.interpolation = _PIL_TO_TV[resample]
        self.do_rescale, self.rescale_factor, self.do_normalize = do_rescale, float(
            rescale_factor), do_normalize
        self.fps, self.num_frames = fps, num_frames
        self.min_frames, self.max_frames = int(min_frames), int(max_frames)
        self.do_sample_frames = do_sample_frames
        self.cap_pixels_per_frame = bool(cap_pixels_per_frame)
        self.max_video_tokens = int(max_video_tokens)
        self.factor = self.patch_size * self.merge_size

    @classmethod
    def from_config_dict(cls, d: dict) -> "Qwen3VLVideoProcessor":
        keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                "resample", "do_rescale", "rescale_factor", "do_normalize", "fps", "num_frames",
                "min_frames", "max_frames", "do_sample_frames", "cap_pixels_per_frame",
                "max_video_tokens")
        kw = {k: d[k] for k in keys if d.get(k) is not None}
        size = d.get("size") or {}
        if size.get("shortest_edge") is not None:
            kw["min_pixels"] = size["shortest_edge"]
        if size.get("longest_edge") is not None:
            kw["max_pixels"] = size["longest_edge"]
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, folder) -> "Qwen3VLVideoProcessor":
        """The checkpoint's video processor settings; transformers' class defaults when it has none.
        """
        d = read_processor_config(folder, "video_processor")
        return cls() if d is None else cls.from_config_dict(d)

    # ----------------------------------------------------------------------------------------------
    # planning

    def sample_indices(self, total_num_frames: int, source_fps: float | None,
                       opts: VideoOptions) -> list[int]:
        """transformers' Qwen3VLVideoProcessor.sample_frames."""
        num_frames = opts.num_frames if opts.num_frames is not None else \
            (self.num_frames if opts.fps is None else None)
        fps = opts.fps if opts.fps is not None else (self.fps if num_frames is None else None)
        min_frames = self.min_frames if opts.min_frames is None else int(opts.min_frames)
        max_frames = self.max_frames if opts.max_frames is None else int(opts.max_frames)
        if num_frames is None and fps is not None:
            source_fps = source_fps or 24  # transformers' assumption (video_io.ASSUMED_FPS)
            num_frames = int(total_num_frames / source_fps * fps)
            num_frames = min(max(num_frames, min_frames), max_frames, total_num_frames)
        if num_frames is None:
            num_frames = min(max(total_num_frames, min_frames), max_frames)
        return np.linspace(0, total_num_frames - 1, int(num_frames)).round().astype(int).tolist()

    def resized_size(self, num_frames: int, height: int, width: int,
                     opts: VideoOptions) -> tuple[int, int]:
        min_pixels = self.min_pixels if opts.video_min_pixels is None else int(
            opts.video_min_pixels)
        max_pixels = self.max_pixels if opts.video_max_pixels is None else int(
            opts.video_max_pixels)
        cap = self.cap_pixels_per_frame if opts.cap_pixels_per_frame is None else \
            opts.cap_pixels_per_frame
        if cap:
            frame_cap = self.max_video_tokens * self.factor * self.factor
            per_frame = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        return video_smart_resize(num_frames, height, width, self.temporal_patch_size, self.factor,
                                  min_pixels, max_pixels)

    def plan(self, opts: VideoOptions):
        """The `plan` video_io.load_video calls once it knows the clip: the frames to take and their
        size."""
        def plan(source: VideoSource) -> tuple[list[int], tuple[int, int]]:
            sample = self.do_sample_frames if opts.do_sample_frames is None else \
                opts.do_sample_frames
            if source.backend == "frames-presampled" or not sample:
                indices = list(range(source.total_num_frames))
            else:
                indices = self.sample_indices(source.total_num_frames, source.fps, opts)
            return indices, self.resized_size(len(indices), source.height, source.width, opts)
        return plan

    def resize(self, frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """uint8 [N, 3, H, W] -> uint8 [N, 3, h, w], torchvision's antialiased resize as
        transformers calls it."""
        if tuple(frames.shape[-2:]) == tuple(size):
            return frames.contiguous()
        return tvF.resize(frames, list(size), interpolation=self.interpolation, antialias=True)

    def timestamps(self, frames_indices: list[int], fps: float) -> list[float]:
        """Qwen3VLProcessor._calculate_timestamps (called with temporal_patch_size, as transformers
        5.24 does)."""
        indices = list(frames_indices)
        t = self.temporal_patch_size
        if len(indices) % t:
            indices.extend(indices[-1] for _ in range(t - len(indices) % t))
        seconds = [i / fps for i in indices]
        return [(seconds[i] + seconds[i + t - 1]) / 2 for i in range(0, len(seconds), t)]

    # ----------------------------------------------------------------------------------------------
    # pixels

    def __call__(self, video: LoadedVideo, opts: VideoOptions, device="cpu") -> ProcessedVideo:
        frames = video.frames  # uint8 [T, 3, h, w], resized
        content_hash = _frames_hash(frames, opts.key(), video.frames_indices, video.fps)
        x = frames.to(device).to(torch.float32)
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, device=x.device)
            std = torch.tensor(self.image_std, device=x.device)
            if self.do_rescale:  # fused as transformers fuses them: (x - mean/s) / (std/s)
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            x = (x - mean[None, :, None, None]) / std[None, :, None, None]
        elif self.do_rescale:
            x = x * self.rescale_factor
        t_patch, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        # an odd count: repeat the last frame, as transformers' patchify does
        if pad := -x.shape[0] % t_patch:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        n, c, h, w = x.shape
        gt, gh, gw = n // t_patch, h // p, w // p
        x = x.view(gt, t_patch, c, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, T, P, P]
        pixel_values = x.reshape(gt * gh * gw, c * t_patch * p * p)
        return ProcessedVideo(pixel_values, (gt, gh, gw),
                              self.timestamps(video.frames_indices, video.fps),
                              list(video.frames_indices), video.fps, (h, w), content_hash)


def _frames_hash(frames: torch.Tensor, options: tuple, indices: list[int], fps: float) -> int:
    """63-bit key over the sampled, resized frames and how they were sampled: the same clip at
    another fps (other frames, other timestamps) or size is another entry in the encoder and prefix
    caches."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((tuple(frames.shape), options, tuple(indices), float(fps))).encode())
    h.update(frames.contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1
