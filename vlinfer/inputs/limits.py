"""The one table of media limits and accepted mm_processor_kwargs keys, and the one refusal of media
by a text-only model. LLM.generate / Pipeline (the engine's multimodal processor), image decoding,
the server and the CLI all read it, so the same over-limit request is refused with the same words on
every surface. The server's flags may set stricter values; their defaults are these. README.md's "##
Defaults" shows this table (tests/project/test_defaults.py checks it)."""

# Images and videos in one request (one prompt): each is decoded and preprocessed before any token
# is counted.
MAX_IMAGES = 16
# Width x height of one image, checked from its header before decoding: 32 Mi pixels (e.g. 8192 x
# 4096) is ~100 MB of RGB, above any real photo and far below what a crafted header can claim (a
# decompression bomb).
MAX_IMAGE_PIXELS = 1 << 25

IMAGE_OPTIONS = ("min_pixels", "max_pixels", "detail")
VIDEO_OPTIONS = ("fps", "num_frames", "min_frames", "max_frames", "video_min_pixels",
                 "video_max_pixels", "cap_pixels_per_frame", "do_sample_frames")
MM_PROCESSOR_KWARGS = IMAGE_OPTIONS + VIDEO_OPTIONS

# (setting, value as README.md writes it, what it bounds): the README's rows.
TABLE = (
    ("max_images", str(MAX_IMAGES), "images and videos per request"),
    ("max_image_pixels", "2^25", "width x height of one image"),
    ("mm_processor_kwargs", ", ".join(MM_PROCESSOR_KWARGS), "accepted keys"),
)


def too_many_images(count: int, limit: int = MAX_IMAGES) -> str:
    return (f"the request has {count} images and videos; the limit is {limit} per request "
            "(max_images)")


def too_many_pixels(width: int, height: int, limit: int = MAX_IMAGE_PIXELS) -> str:
    return (
        f"image is {width}x{height} = {width * height} pixels, over the limit of {limit} pixels "
        "(max_image_pixels); possible decompression bomb")


def unknown_mm_kwargs(keys) -> str:
    return f"unknown mm_processor_kwargs {sorted(keys)}; accepted: {', '.join(MM_PROCESSOR_KWARGS)}"


def text_only(model: str, what: str = "images", language_model_only: bool = False) -> str:
    """The refusal of media (what: "images", "videos") by a model without a vision encoder, or by
    a vision-language model run without its tower (EngineConfig.language_model_only)."""
    if language_model_only:
        return (f"model {model!r} runs with language_model_only=True (its vision tower is not "
                f"built) and does not accept {what}")
    return f"model {model!r} is a text-only model and does not accept {what}"
