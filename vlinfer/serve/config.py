"""The server's settings (vlinfer/cli/serve.py builds them from its flags): who may call it, what one request
may cost, and what one image or video may be."""
from dataclasses import dataclass, field

from vlinfer.multimodal.video_io import VideoLimits
from vlinfer.serve.security import ImagePolicy


@dataclass
class ServeConfig:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = 32 * 2 ** 20
    images: ImagePolicy = field(default_factory=ImagePolicy)
    max_n: int = 16  # choices per request (n) times prompts per /v1/completions request
    max_pending: int = 1024  # sequences queued or running before new requests get 503
    max_pooling_inputs: int = 512  # inputs of one /v1/embeddings request; items or pairs of one /score, /rerank
    trim_memory_when_idle: bool = True  # hand freed heap pages back to the OS once a burst is over (glibc)
    # vLLM's structured-outputs option: JSON the server constrains has no free whitespace (a request's own
    # structured_outputs.disable_any_whitespace wins). Small models otherwise pad JSON with newlines.
    disable_any_whitespace: bool = True
    # What one video may cost (frames sampled, seconds, frame size): the engine's video limits while it serves
    # this app (--max-video-frames, --max-video-seconds).
    video: VideoLimits = field(default_factory=lambda: VideoLimits(max_frames=768, max_seconds=3600.0))
