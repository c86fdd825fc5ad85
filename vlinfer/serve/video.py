"""video_url parts of chat requests -> the bytes the engine decodes
(vlinfer/multimodal/video_io.py).

Under the image policy's rules with its own byte limit (--max-video-bytes): base64 data URIs (media
type video/*), file:// URLs only below --allowed-local-root, and http(s) URLs from the hosts images
may come from (fetched on the event loop with the images, serve/media.py). The engine then applies
its video limits (frame size, frames in the file, duration; VideoLimits) from the container's header
and packet index before decoding."""
import base64
import binascii

from vlinfer.multimodal.video_io import VideoLimits
from vlinfer.multimodal.video_processor import VideoOptions
from vlinfer.serve import security
from vlinfer.serve.errors import ApiError

BOOLEAN_OPTIONS = ("cap_pixels_per_frame", "do_sample_frames")


def video_bytes(url: str, policy: security.ImagePolicy, param: str,
                fetched: bytes | None = None) -> bytes:
    """A video part's bytes within the policy's video byte limit: an http(s) URL's fetched bytes
    (media.fetch_urls fetched them, under the same host rules as images), a base64 data URI, or a
    file below --allowed-local-root."""
    policy = policy.for_videos()
    kind = security.image_kind(url)
    if kind == "http":
        return fetched
    if kind == "file":
        return security.read_local_file(url, policy, param)
    if kind != "data":
        raise security.unsupported_source(url, param)
    header, sep, payload = url.partition(",")
    options = header[5:].lower().split(";")
    if not sep or "base64" not in options:
        raise ApiError(400, "a video data URI must be base64: data:video/mp4;base64,...",
                       param=param)
    if options[0] and not options[0].startswith("video/"):
        raise ApiError(400, f"data URI media type is {options[0]!r}, not a video", param=param)
    if len(payload
           ) > 4 * (policy.max_video_bytes // 3 + 2) + payload.count("\n") + payload.count("\r"):
        raise ApiError(
            400,
            f"video is larger than the limit of {policy.max_video_bytes} bytes (--max-video-bytes)",
            param=param)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"data URI payload is not valid base64: {e}", param=param) from None


def check_video_options(options: dict, engine, limits: VideoLimits) -> None:
    """mm_processor_kwargs' video keys (one value for every video of the request): the video
    processor's own checks (types, fps and num_frames exclusive), frame counts within
    --max-video-frames, and pixel budgets within the checkpoint's video max_pixels: a request may
    shrink a clip's budget, never grow it past what the model's config allows (a huge
    video_min_pixels would upscale every frame before any token count is known)."""
    param = "mm_processor_kwargs"
    if not engine.is_multimodal:
        raise ApiError(400, "video options were given but this model takes no videos", param=param)
    for key in BOOLEAN_OPTIONS:
        if key in options and not isinstance(options[key], bool):
            raise ApiError(400, f"mm_processor_kwargs.{key} must be true or false",
                           param=f"{param}.{key}")
    try:
        opts = VideoOptions.of(options)
    except ValueError as e:
        raise ApiError(400, f"mm_processor_kwargs: {e}", param=param) from None
    for key in ("num_frames", "max_frames", "min_frames"):
        value = getattr(opts, key)
        if value is not None and limits.max_frames is not None and value > limits.max_frames:
            raise ApiError(400, f"mm_processor_kwargs.{key}={value} is over this server's limit of "
                                f"{limits.max_frames} frames per video", param=f"{param}.{key}")
    most = engine.input_processor.mm_processor.videos.processor.max_pixels
    for key in ("video_min_pixels", "video_max_pixels"):
        value = getattr(opts, key)
        if value is not None and value > most:
            raise ApiError(
                400,
                f"mm_processor_kwargs.{key}={value} is over the model's video budget of {most} "
                "pixels per clip", param=f"{param}.{key}")
