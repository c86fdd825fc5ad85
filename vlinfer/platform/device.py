"""What the device is and what it holds: which device, which dtype it computes in, its memory, its
KV block size and its collective backend."""
import logging

import torch

from vlinfer.platform import cpu_features

logger = logging.getLogger("vlinfer")


def npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:  # torch_npu raises more than ImportError without the CANN runtime
        return False
    return torch.npu.is_available()


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) != "auto":
        try:
            dev = torch.device(device)
        # torch's message lists every backend it was built to know
        except (RuntimeError, TypeError):
            raise ValueError(
                f"device={str(device)!r} is not a device; use 'auto', 'cpu', 'cuda', 'cuda:N' or "
                "'npu'") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r}: CUDA is not available on this machine; use 'auto' or "
                "'cpu'"
            )
        if dev.type == "npu" and not npu_available():
            raise ValueError(
                f"device={str(device)!r}: torch_npu / the CANN runtime is not available on this "
                "machine; use 'auto' or 'cpu'")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if npu_available():
        return torch.device("npu")
    return torch.device("cpu")


_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, hf_config,
                  device: torch.device | None = None) -> torch.dtype:
    """An explicit dtype is always obeyed. "auto" takes the checkpoint's dtype, except on a CPU
    without native arithmetic for it (bf16 / fp16 checkpoints on an AVX2-only CPU): float32 there.
    The choice is logged."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    config_dtype = getattr(hf_config.get_text_config(), "dtype", None) or getattr(
        hf_config, "dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    chosen = config_dtype if isinstance(config_dtype, torch.dtype) else torch.float32
    if device is not None and device.type == "cpu" and chosen in (torch.bfloat16, torch.float16):
        flags = cpu_features.cpu_flags()
        if not cpu_features.cpu_has_native(chosen, flags):
            logger.info(
                "dtype: float32, this CPU has no native %s (%s); the checkpoint is %s, pass dtype= "
                "to "
                "override", _dtype_name(chosen), cpu_features.cpu_isa(flags), _dtype_name(chosen))
            return torch.float32
    logger.info("dtype: %s, the checkpoint's", _dtype_name(chosen))
    return chosen


def holds_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `device` keeps a cache in `dtype` at native speed: float32 anywhere; a 16-bit dtype
    on a CPU with native arithmetic for it (cpu_features.cpu_has_native: else every read and write
    converts in software), on CUDA where the card has it (bf16: Ampere and later), on NPU."""
    if dtype == torch.float32:
        return True
    if device.type == "cpu":
        return cpu_features.cpu_has_native(dtype)
    if device.type == "cuda" and dtype == torch.bfloat16:
        return torch.cuda.is_bf16_supported()
    return dtype in (torch.bfloat16, torch.float16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def distributed_backend(device: torch.device) -> str:
    """The torch.distributed backend a tensor-parallel engine's collectives run on, for its device.
    """
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")
