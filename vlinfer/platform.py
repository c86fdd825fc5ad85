"""What the device is and what it can do. Nothing else in vlinfer branches on the device type."""
import importlib.util
import logging

import torch

logger = logging.getLogger("vlinfer")


def npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:  # torch_npu raises more than ImportError without the CANN runtime
        return False
    return torch.npu.is_available()


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) != "auto":
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if dev.type == "npu" and not npu_available():
            raise ValueError(f"device {device!r} requested but torch_npu / the CANN runtime is not available")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if npu_available():
        return torch.device("npu")
    return torch.device("cpu")


_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, hf_config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    config_dtype = getattr(hf_config.get_text_config(), "dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    return config_dtype if isinstance(config_dtype, torch.dtype) else torch.float32


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache: free RAM on CPU, free device memory on accelerators."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device)
    return 0


def total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[1]
    return available_memory(device)


def default_block_size(device: torch.device) -> int:
    """KV cache block size when the user gives none (kvcache_block_size=None, the default)."""
    if device.type == "npu":  # the only block size every torch_npu paged attention path accepts
        return 128
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        # flash_attn's paged KV cache needs a multiple of 256 (vlinfer/ops/cuda.py); other sizes run SDPA.
        return 256
    return 16
