import math
from dataclasses import dataclass

import torch

INIT_SCHEMES = ("tcp://", "env://", "file://")  # the rendezvous URLs torch.distributed understands


@dataclass
class EngineConfig:
    model: str
    device: str | torch.device = "auto"
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # tokens per step; None: enough for a full-length prompt
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
        for name in ("max_num_seqs", "kvcache_block_size", "max_model_len", "max_num_batched_tokens",
                     "kv_cache_bytes", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization!r}")
        for name in ("distributed_timeout_s", "distributed_startup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        method = self.distributed_init_method
        if method is not None and not (isinstance(method, str) and method.startswith(INIT_SCHEMES)):
            raise ValueError(f"distributed_init_method must be None, 'tcp://host:port' or 'env://', got {method!r}")
