"""Picks the op implementation for an engine's device and logs the choice. The only place that knows which device
implementation runs. Each call returns a new op table: an engine owns its own, nothing here is shared."""
import logging
import os

from vlinfer.ops.reference import ReferenceOps

logger = logging.getLogger("vlinfer")

OPS = ("store_kvcache", "paged_attention", "store_quantized_kvcache", "quantized_paged_attention", "apply_rotary", "rms_norm", "add_rms_norm", "silu_and_mul",
       "gelu_tanh", "varlen_attention", "linear", "fused_moe", "pack_moe_weights",
       "w8a8_dynamic_linear", "w8a8_static_linear", "weight_only_linear", "pack_quantized_linear",
       "gguf_linear", "gguf_embedding", "pack_gguf_weight", "add_lora")
# VLINFER_OPS=<name> forces one implementation whatever the device, e.g. the NPU code on CPU tensors under an
# emulated torch_npu (tests/fake_torch_npu.py). A forced implementation that cannot load is an error, not a fallback.
OVERRIDE_ENV = "VLINFER_OPS"
IMPLEMENTATIONS = ("cuda", "npu", "cpu-compiled", "reference")
# The implementation each device type gets by default; other device types run the reference.
DEVICE_KERNELS = {"cpu": "cpu-compiled", "npu": "npu", "cuda": "cuda"}
_KERNEL_NAMES = {"cpu-compiled": "compiled CPU kernels", "npu": "torch_npu kernels", "cuda": "CUDA kernels"}


def _load(name: str, device_type: str) -> ReferenceOps:
    """A new instance of the implementation called name, loaded for device_type; raises when it cannot load."""
    if name == "reference":
        return ReferenceOps(device_type)
    if name == "cpu-compiled":
        from vlinfer.ops.cpu import CpuOps
        return CpuOps(device_type)
    if name == "cuda":
        from vlinfer.ops.cuda import CudaOps
        return CudaOps(device_type)
    from vlinfer.ops.npu import NpuOps
    return NpuOps(device_type)


def select(device_type: str, use_kernels: bool = True, forced: str | None = None) -> ReferenceOps:
    """The op table for device_type. `forced` (else $VLINFER_OPS) names an implementation to use whatever the
    device; a forced one that cannot load raises. Falling back to the reference is never silent: it is logged as a
    warning with the reason."""
    forced = (forced if forced is not None else os.environ.get(OVERRIDE_ENV, "")).strip()
    if forced:
        if forced not in IMPLEMENTATIONS:
            raise ValueError(f"{OVERRIDE_ENV}={forced!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
        logger.warning("ops: %s forced on device type %s", forced, device_type)
        ops = _load(forced, device_type)
    elif use_kernels and device_type in DEVICE_KERNELS:
        kernels = DEVICE_KERNELS[device_type]
        try:
            ops = _load(kernels, device_type)
        except Exception as e:  # no compiler, no headers, no torch_npu / CANN, ...
            logger.warning("ops: %s unavailable (%s: %s); running the pure-torch reference", _KERNEL_NAMES[kernels],
                           type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            ops = ReferenceOps(device_type)
    else:
        ops = ReferenceOps(device_type)
    logger.info("ops: %s implementation for %s", ops.describe(), device_type)
    return ops
