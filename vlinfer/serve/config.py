"""The server's settings (vlinfer/cli/serve.py builds them from its flags): who may call it, what
one request may cost, what one image or video may be, and the LoRA adapters it serves by name."""
from dataclasses import dataclass, field

from vlinfer.multimodal.video_io import VideoLimits
from vlinfer.serve.limits import MAX_VIDEO_FRAMES, MAX_VIDEO_SECONDS
from vlinfer.serve.security import ImagePolicy
from vlinfer.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class LoRAModule:
    """One adapter served from the start (vLLM's --lora-modules): clients name it in `model`;
    /v1/models lists it with `parent` = base_model_name (default: the first served model name)."""
    name: str
    path: str
    base_model_name: str | None = None


@dataclass
class ServeConfig:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = 32 * 2 ** 20
    images: ImagePolicy = field(default_factory=ImagePolicy)
    max_n: int = 16  # choices per request (n) times prompts per /v1/completions request
    max_pending: int = 1024  # sequences queued or running before new requests get 503
    # inputs of one /v1/embeddings request; items or pairs of one /score, /rerank
    max_pooling_inputs: int = 512
    # hand freed heap pages back to the OS once a burst is over (glibc)
    trim_memory_when_idle: bool = True
    # vLLM's structured-outputs option: JSON the server constrains has no free whitespace (a
    # request's own structured_outputs.disable_any_whitespace wins); StructuredOutputsParams'
    # default.
    disable_any_whitespace: bool = StructuredOutputsParams.disable_any_whitespace
    # the chat template requests are rendered with (--chat-template, vLLM's); None: the model's own
    chat_template: str | None = None
    # max_tokens of a chat or completion request that gives none (--max-tokens-default). None:
    # the rest of the context, vLLM's rule.
    max_tokens_default: int | None = None
    # wall-clock seconds one request may take from arrival (--request-timeout): a sequence still
    # generating then ends with finish_reason "length" (engine/output_processor.py; logged). None:
    # no limit.
    request_timeout_s: float | None = None
    # What one video may cost (frames sampled, seconds, frame size): the engine's video limits while
    # it serves this app (--max-video-frames, --max-video-seconds).
    video: VideoLimits = field(
        default_factory=lambda: VideoLimits(max_frames=MAX_VIDEO_FRAMES,
                                            max_seconds=MAX_VIDEO_SECONDS))
    # LoRA adapters (the engine needs enable_lora): those served from the start, and whether clients
    # may load and unload more (/v1/load_lora_adapter, /v1/unload_lora_adapter; vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    lora_modules: tuple[LoRAModule, ...] = ()
    allow_runtime_lora_updating: bool = False
    # chat template variables every chat request gets (--default-chat-template-kwargs, vLLM's), a
    # request's own chat_template_kwargs over them; e.g. {"enable_thinking": False}
    default_chat_template_kwargs: dict | None = None
