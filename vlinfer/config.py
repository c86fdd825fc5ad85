from dataclasses import dataclass

import torch


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
    enforce_eager: bool = False  # False: decode steps replay captured graphs where the device has them (CUDA, NPU)
    tensor_parallel_size: int = 1
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
