"""Video input layer: whatever a request carries (a file path, bytes, a data URI, a URL, a list of
frames, a uint8 array) -> the sampled frames as one uint8 tensor [T, 3, h, w], already resized, plus
where they came from.

Sampling needs to know the clip (frame count, source fps) before any frame is decoded, and the
target size needs only the sampled count and the source size, so `load_video` asks its caller for
both through `plan` (the video processor's sampler and sizer) and then decodes just the sampled
frames, resizing each as it arrives: a long clip at 4K never sits in memory at full size. Files are
decoded with PyAV (FFmpeg); the demuxer gives every packet's timestamp and keyframe flag without
decoding, so the decoder seeks to the keyframe before a sampled frame when a keyframe lies between
it and the last frame decoded, and decodes on otherwise.

Failures are `VideoLoadError` (a ValueError) with a message a client can act on, never a bare FFmpeg
error.
"""
from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from vlinfer.multimodal.source_open import open_string_source
from vlinfer.multimodal.url_fetch import UrlPolicy

logger = logging.getLogger("vlinfer")

# transformers assumes this source frame rate when a clip of frames comes without one
# (Qwen3VLVideoProcessor .sample_frames and Qwen3VLProcessor.replace_video_token both do); so do we,
# and say so in the log and the echo.
ASSUMED_FPS = 24.0
# File name endings taken for video files where a path's kind must be told by its name (the caption
# CLI's folders, the demo's uploads): containers FFmpeg reads.
VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".wmv",
                    ".flv", ".3gp", ".ts")


class VideoLoadError(ValueError):
    """The input could not be turned into video frames (unreadable, corrupt, too large or long,
    refused source)."""


@dataclass
class VideoLimits:
    """What one video may cost before anything is decoded. The defaults bound memory and time, not
    content: a frame above max_frame_pixels or a clip above max_source_frames / max_seconds is
    refused from its header and packet index alone (an archive bomb of a few KiB that declares 10^6
    frames or 30000x30000 pixels)."""
    max_frame_pixels: int = 1 << 25     # 32 Mi pixels per frame (8192 x 4096), ~100 MB decoded
    max_source_frames: int = 1 << 18    # frames in the file (an hour at 72 fps)
    max_seconds: float | None = 4 * 3600.0
    # bytes / data URIs; None: no limit here (the server sets one)
    max_bytes: int | None = None
    # Frames sampled from one clip (what is decoded and encoded); None: the video processor's
    # max_frames alone. Sampling clamps to it, as to max_frames; a request asking for more
    # (num_frames, max_frames, a longer list of frames not to resample) is refused
    # (video_prompt.VideoPrompts.load).
    max_frames: int | None = None


@dataclass
class VideoSource:
    """The clip as the sampler sees it: transformers' VideoMetadata fields."""
    total_num_frames: int
    fps: float | None             # source frame rate; None when the input did not say
    height: int
    width: int
    frames_indices: list[int] | None = None  # pre-sampled frames: their indices in the source
    backend: str = "pyav"

    @property
    def duration(self) -> float | None:
        return self.total_num_frames / self.fps if self.fps else None


@dataclass
class LoadedVideo:
    frames: torch.Tensor            # uint8 [T, 3, h, w], sampled and resized
    frames_indices: list[int]       # source index of each frame
    fps: float                      # the source fps the timestamps use (ASSUMED_FPS when unknown)
    source: VideoSource


# plan(source) -> (indices into the input's frames, target (h, w) for that many frames)
Plan = Callable[[VideoSource], tuple[list[int], tuple[int, int]]]
# resize(frames uint8 [N, 3, H, W], (h, w)) -> uint8 [N, 3, h, w]
Resize = Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]


def load_video(source, plan: Plan, resize: Resize, *, metadata: dict | None = None,
               url_policy: UrlPolicy | None = None,
               limits: VideoLimits | None = None) -> LoadedVideo:
    """source: a path (str / Path), bytes, a base64 `data:video/...` URI, an http(s) URL (with a
    url_policy), a list of frames (PIL images or HWC uint8 arrays), or a uint8 array / tensor [T, H,
    W, 3]. metadata (frames only): {"fps": source fps, "frames_indices": source index of each given
    frame, "total_num_frames": ...}, the fields of transformers' VideoMetadata."""
    limits = limits or VideoLimits()
    if isinstance(source, (list, tuple, np.ndarray, torch.Tensor)):
        return _load_frames(source, plan, resize, metadata or {}, limits)
    if metadata:
        raise VideoLoadError(
            "video metadata goes with a list or array of frames; a video file carries its own")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), "bytes", plan, resize, limits)
    if isinstance(source, Path):
        return _decode_path(source, plan, resize, limits)
    if isinstance(source, str):
        opened, what = open_string_source(source, "video", VideoLoadError, url_policy=url_policy,
                                          max_bytes=limits.max_bytes)
        if isinstance(opened, Path):
            return _decode_path(opened, plan, resize, limits)
        return _decode(opened, what, plan, resize, limits)
    raise VideoLoadError(
        f"unsupported video source type {type(source).__name__}; expected a path, bytes, data "
        "URI, URL, a list of frames or a uint8 array [T, H, W, 3]")


def import_av():
    try:
        import av
    except ImportError:
        raise VideoLoadError(
            "video files are decoded with PyAV, which is not installed: pip install av (or "
            "pip install 'vlinfer[video]'); a list of frames or a uint8 array needs no decoder"
        ) from None
    return av


# ------------------------------------------------------------------------------------------------
# frames given


def _load_frames(frames, plan: Plan, resize: Resize, metadata: dict,
                 limits: VideoLimits) -> LoadedVideo:
    unknown = set(metadata) - {
        "fps", "frames_indices", "total_num_frames", "duration", "video_backend",
        "do_sample_frames", "height", "width"
    }
    if unknown:
        raise VideoLoadError(
            f"unknown video metadata keys {sorted(unknown)}; accepted: fps, frames_indices, "
            "total_num_frames, duration, do_sample_frames")
    clip = _frames_tensor(frames, limits)  # uint8 [N, 3, H, W]
    n, _, height, width = clip.shape
    fps = metadata.get("fps")
    if fps is not None and not (isinstance(fps, (int, float)) and fps > 0):
        raise VideoLoadError(f"video metadata fps must be a positive number, got {fps!r}")
    given = metadata.get("frames_indices")
    if given is not None:
        given = [int(i) for i in given]
        if len(given) != n or any(i < 0 for i in given) or any(b <= a
                                                               for a, b in zip(given, given[1:])):
            raise VideoLoadError(
                f"video metadata frames_indices must be {n} increasing source indices, one per "
                "frame")
    # Given indices mean the frames are already sampled (vLLM's and transformers' convention for
    # (frames, metadata) pairs); sample them again only when asked.
    resample = metadata.get("do_sample_frames", given is None)
    total = int(metadata.get("total_num_frames") or (given[-1] + 1 if given else n))
    info = VideoSource(total_num_frames=n if resample else total, fps=float(fps) if fps else None,
                       height=height, width=width, frames_indices=given, backend="frames")
    if resample:
        indices, size = plan(info)
        source_indices = [given[i] for i in indices] if given else list(indices)
    else:
        # Not resampled: the plan only sizes them (its indices are ignored).
        _, size = plan(VideoSource(n, info.fps, height, width, given, "frames-presampled"))
        indices = list(range(n))
        source_indices = given if given else indices
    if info.fps is None:
        logger.warning(
            "a video given as frames has no fps in its metadata: timestamps assume %s fps, as "
            "transformers does; pass (frames, {'fps': ...}) for true times", ASSUMED_FPS)
    picked = clip[torch.as_tensor(indices, dtype=torch.long)]
    return LoadedVideo(resize(picked, size), source_indices, info.fps or ASSUMED_FPS, info)


def _frames_tensor(frames, limits: VideoLimits) -> torch.Tensor:
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise VideoLoadError("the video has no frames")
        arrays = []
        for i, frame in enumerate(frames):
            if isinstance(frame, PIL.Image.Image):
                _check_frame_pixels(frame.width, frame.height, limits)
                frame = np.asarray(frame.convert("RGB"))
            elif isinstance(frame, torch.Tensor):
                frame = frame.detach().cpu().numpy()
            if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[
                    -1] != 3 or frame.dtype != np.uint8:
                raise VideoLoadError(
                    f"video frame {i} must be a PIL image or a uint8 array [H, W, 3]")
            arrays.append(frame)
        if len({a.shape for a in arrays}) != 1:
            raise VideoLoadError(
                f"video frames differ in size: {sorted({a.shape[:2] for a in arrays})[:4]}")
        clip = torch.from_numpy(np.stack(arrays))
    else:
        clip = torch.from_numpy(np.ascontiguousarray(frames)) if isinstance(
            frames, np.ndarray) else frames.detach()
        if clip.ndim != 4 or clip.shape[-1] != 3 or clip.dtype != torch.uint8:
            raise VideoLoadError(f"a video array must be uint8 [T, H, W, 3], got {clip.dtype} "
                                 f"{list(clip.shape)}")
        clip = clip.cpu()
    if clip.shape[0] == 0:
        raise VideoLoadError("the video has no frames")
    _check_frame_pixels(clip.shape[2], clip.shape[1], limits)
    return clip.permute(0, 3, 1, 2)


# ------------------------------------------------------------------------------------------------
# files

def _decode_path(path: Path, plan: Plan, resize: Resize, limits: VideoLimits) -> LoadedVideo:
    if not path.is_file():
        raise VideoLoadError(f"video file not found: {path}")
    if limits.max_bytes is not None and path.stat().st_size > limits.max_bytes:
        raise VideoLoadError(
            f"video file is {path.stat().st_size} bytes, over the limit of {limits.max_bytes}")
    return _decode(str(path), str(path), plan, resize, limits)


def _decode(data: bytes | str, what: str, plan: Plan, resize: Resize,
            limits: VideoLimits) -> LoadedVideo:
    av = import_av()
    if isinstance(data, bytes):
        if not data:
            raise VideoLoadError(f"cannot read video from {what}: no data")
        if limits.max_bytes is not None and len(data) > limits.max_bytes:
            raise VideoLoadError(
                f"video is {len(data)} bytes, over the limit of {limits.max_bytes}")
    try:
        container = av.open(io.BytesIO(data) if isinstance(data, bytes) else data, mode="r",
                            metadata_errors="ignore")
    except av.FFmpegError as e:
        raise VideoLoadError(
            f"cannot read video from {what} (not a video, or an unsupported container): "
            f"{_ffmpeg_message(e)}") from None
    try:
        with container:
            return _decode_container(av, container, what, plan, resize, limits)
    except av.FFmpegError as e:
        raise VideoLoadError(
            f"corrupt or truncated video data in {what}: {_ffmpeg_message(e)}") from None


def _decode_container(av, container, what: str, plan: Plan, resize: Resize,
                      limits: VideoLimits) -> LoadedVideo:
    if not container.streams.video:
        raise VideoLoadError(f"{what} has no video stream (not a video)")
    stream = container.streams.video[0]
    # a codec id FFmpeg has no decoder for: an unknown or damaged stream header
    if stream.codec_context is None:
        raise VideoLoadError(
            f"video in {what} has a video stream FFmpeg cannot decode (unknown or damaged codec)")
    stream.thread_type = "AUTO"
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0:
        raise VideoLoadError(f"video in {what} has an empty frame size {width}x{height}")
    _check_frame_pixels(width, height, limits)
    fps = float(stream.average_rate) if stream.average_rate else None
    if fps is not None and not fps > 0:
        fps = None
    # The packet index: one packet per frame. Container headers' frame counts are missing (webm,
    # mkv) or can lie (qv#1770); counting packets reads the file once without decoding, and stops at
    # the limit.
    packets = []  # (pts, is_keyframe)
    for packet in container.demux(stream):
        if packet.size == 0:  # the demuxer's end-of-stream flush packet
            continue
        packets.append((packet.pts if packet.pts is not None else packet.dts, packet.is_keyframe))
        if len(packets) > limits.max_source_frames:
            raise VideoLoadError(f"video in {what} has more than {limits.max_source_frames} frames "
                                 "(max_source_frames)")
    if not packets:
        raise VideoLoadError(f"video in {what} has no frames")
    total = len(packets)
    if fps is None:
        logger.warning(
            "video in %s declares no frame rate: timestamps assume %s fps, as transformers does",
            what, ASSUMED_FPS)
    seconds = total / (fps or ASSUMED_FPS)
    if limits.max_seconds is not None and seconds > limits.max_seconds:
        raise VideoLoadError(
            f"video in {what} is {seconds:.0f} s long, over the limit of {limits.max_seconds:.0f} s"
        )
    source = VideoSource(total, fps, height, width)
    indices, size = plan(source)
    frames = _decode_frames(container, stream, packets, sorted(set(indices)), what)
    by_index = {}
    for index, frame in frames.items():
        by_index[index] = resize(frame[None], size)[0]
    return LoadedVideo(torch.stack([by_index[i] for i in indices]), list(indices), fps or
                       ASSUMED_FPS, source)


def _decode_frames(container, stream, packets, wanted: list[int],
                   what: str) -> dict[int, torch.Tensor]:
    """uint8 [3, H, W] of each wanted frame (presentation order index). Seeks to a keyframe when one
    lies between the last frame decoded and the next wanted one; decodes straight on otherwise."""
    pts_sorted = sorted(p for p, _ in packets)
    if any(p is None for p in pts_sorted) or len(set(pts_sorted)) != len(pts_sorted):
        return _decode_sequential(container, stream, wanted, what)
    index_of = {p: i for i, p in enumerate(pts_sorted)}
    keyframes = sorted(index_of[p] for p, key in packets if key)
    out: dict[int, torch.Tensor] = {}
    position = None  # presentation index of the last frame decoded
    decoder = None
    for target in wanted:
        jump = position is None or any(position < k <= target for k in keyframes)
        if jump:  # the first frame too: the demux pass left the container at its end
            container.seek(int(pts_sorted[target]), backward=True, any_frame=False, stream=stream)
            decoder = None
        if decoder is None:
            decoder = container.decode(stream)
        while True:
            frame = next(decoder, None)
            if frame is None:
                raise VideoLoadError(
                    f"video in {what} ended before frame {target} of {len(pts_sorted)} "
                    "(truncated?)")
            index = index_of.get(frame.pts)
            # a timestamp the demuxer did not list: trust only a plain decode then
            if index is None:
                return _decode_sequential(container, stream, wanted, what)
            # the seek landed past it (a broken index): decode from the start instead
            if index > target:
                return _decode_sequential(container, stream, wanted, what)
            position = index
            if index == target:
                out[target] = _frame_to_tensor(frame)
                break
    return out


def _decode_sequential(container, stream, wanted: list[int], what: str) -> dict[int, torch.Tensor]:
    container.seek(0)
    out, want, decoded = {}, set(wanted), 0
    for index, frame in enumerate(container.decode(stream)):
        decoded = index + 1
        if index in want:
            out[index] = _frame_to_tensor(frame)
            if len(out) == len(want):
                return out
    raise VideoLoadError(
        f"video in {what} ended after {decoded} frames, before frame {max(want - set(out))} "
        "(truncated?)")


def _frame_to_tensor(frame) -> torch.Tensor:
    # rgb24 through FFmpeg's swscale, as transformers' PyAV loader converts
    # (video_utils.read_video_pyav).
    return torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)


# ------------------------------------------------------------------------------------------------
# helpers

def _check_frame_pixels(width: int, height: int, limits: VideoLimits) -> None:
    if width <= 0 or height <= 0:
        raise VideoLoadError(f"video frames have an empty size {width}x{height}")
    if width * height > limits.max_frame_pixels:
        raise VideoLoadError(
            f"video frames are {width}x{height} = {width * height} pixels, over the limit of "
            f"{limits.max_frame_pixels} pixels per frame; possible decompression bomb")


def _ffmpeg_message(e) -> str:
    return getattr(e, "strerror", None) or str(e)
