import math
from dataclasses import dataclass

import torch

INIT_SCHEMES = ("tcp://", "env://", "file://")  # the rendezvous URLs torch.distributed understands
# A max_model_len fitted to the KV cache is at least this long (or the model's own length when shorter): room for
# a useful prompt and answer. A pool that holds fewer tokens is an error.
MIN_FITTED_MODEL_LEN = 2048
MIN_BATCHED_TOKENS = 2048  # the default max_num_batched_tokens is never below this
# The default max_num_batched_tokens when max_model_len is fitted: on accelerators the memory profile that sizes
# the KV pool (and so the fitted length) runs one step of max_num_batched_tokens, so that step cannot wait for
# the length; bounded, it stays small next to the pool it measures.
MAX_FITTED_BATCHED_TOKENS = 8192
# The CLI, the server and the demo run at the model's own context length, at most this (max_model_len_cap), when
# no --max-model-len is given: enough for a chat with images, without a pool sized for 262144-token contexts.
APP_MAX_MODEL_LEN = 8192


@dataclass
class EngineConfig:
    model: str
    device: str | torch.device = "auto"
    dtype: str | torch.dtype = "auto"
    # None: the model's max_position_embeddings (at most max_model_len_cap), lowered to what the KV cache holds
    # when it holds less (a warning says so), down to MIN_FITTED_MODEL_LEN. A length given here must fit.
    max_model_len: int | None = None
    max_model_len_cap: int | None = None  # with max_model_len=None: use at most this many (the apps' default)
    max_num_seqs: int = 256
    # Tokens per step. None: enough for a full-length prompt, at least 2048; with a fitted max_model_len, at most
    # MAX_FITTED_BATCHED_TOKENS (longer prompts prefill in chunks), see LLMEngine._init.
    max_num_batched_tokens: int | None = None
    # None: the device's default (platform.default_block_size): 16 on CPU, 128 on NPU, 256 on CUDA with flash_attn.
    kvcache_block_size: int | None = None
    # Share of memory for weights + activations + KV cache on accelerators; on CPU, of the RAM free after load.
    memory_utilization: float | None = None
    kv_cache_bytes: int | None = None  # exact KV pool size, overriding memory_utilization
    enable_prefix_caching: bool = True
    # Force one op implementation for this engine ("cpu-compiled", "reference", "cuda", "npu"); None: $VLINFER_OPS
    # if set, else the device's own kernels. Another engine in the process keeps its own choice.
    ops: str | None = None
    enforce_eager: bool = False  # False: decode steps replay captured graphs where the device has them (CUDA, NPU)
    tensor_parallel_size: int = 1
    # Where tensor-parallel ranks meet. None: spawned local workers on a port the OS picks (under torchrun, i.e. with
    # RANK / WORLD_SIZE set: env://); "tcp://host:port": there, rank 0 hosts the store; "env://": MASTER_ADDR /
    # MASTER_PORT.
    distributed_init_method: str | None = None
    distributed_timeout_s: float = 60.0  # a step's collectives: how long a rank may wait for the others
    distributed_startup_timeout_s: float = 600.0  # workers starting, connecting and loading their shard
    seed: int = 0
    allow_image_urls: bool = False  # fetch http(s) image URLs; off so a request cannot make the engine fetch

    def __post_init__(self):
        for name in ("max_num_seqs", "kvcache_block_size", "max_model_len", "max_model_len_cap",
                     "max_num_batched_tokens", "kv_cache_bytes", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.memory_utilization is not None and not (isinstance(self.memory_utilization, (int, float)) and
                                                        0 < self.memory_utilization <= 1):
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization!r}")
        for name in ("distributed_timeout_s", "distributed_startup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        method = self.distributed_init_method
        if method is not None and not (isinstance(method, str) and method.startswith(INIT_SCHEMES)):
            raise ValueError(f"distributed_init_method must be None, 'tcp://host:port' or 'env://', got {method!r}")
