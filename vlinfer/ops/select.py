"""Picks the op table for an engine's device and logs the choice: the only place that maps device
types to backends. Each call returns a new table: an engine owns its own, nothing here is shared."""
import logging
import os

from vlinfer.ops.interface import Backend
from vlinfer.ops.reference import ReferenceOps

logger = logging.getLogger("vlinfer")

# VLINFER_OPS=<name> forces one implementation whatever the device, e.g. the NPU code on CPU tensors
# under an emulated torch_npu (tests/fakes/fake_torch_npu.py). A forced implementation that cannot
# load is an error, not a fallback.
OVERRIDE_ENV = "VLINFER_OPS"
IMPLEMENTATIONS = ("cuda", "npu", "cpu-compiled", "reference")
# The implementation each device type gets by default; other device types run the reference.
DEVICE_KERNELS = {"cpu": "cpu-compiled", "npu": "npu", "cuda": "cuda"}
_KERNEL_NAMES = {
    "cpu-compiled": "compiled CPU kernels", "npu": "torch_npu kernels", "cuda": "CUDA kernels"
}


def backend_class(name: str) -> type[Backend]:
    """The table class of the implementation called name (importing its package loads no kernel)."""
    if name == "reference":
        return ReferenceOps
    if name == "cpu-compiled":
        from vlinfer.ops.cpu import CpuOps
        return CpuOps
    if name == "cuda":
        from vlinfer.ops.cuda import CudaOps
        return CudaOps
    from vlinfer.ops.npu import NpuOps
    return NpuOps


def _forced(forced: str | None) -> str:
    forced = (forced if forced is not None else os.environ.get(OVERRIDE_ENV, "")).strip()
    if forced and forced not in IMPLEMENTATIONS:
        raise ValueError(f"{OVERRIDE_ENV}={forced!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    return forced


def default_block_size(device_type: str) -> int:
    """KV tokens per block when the user gives none: the rule of the backend this device type gets
    by default (its kernels' limits), asked before the table is built."""
    backend = backend_class(DEVICE_KERNELS.get(device_type, "reference"))
    return backend.default_block_size(device_type)


def select(device_type: str, use_kernels: bool = True, forced: str | None = None) -> Backend:
    """The op table for device_type. `forced` (else $VLINFER_OPS) names an implementation to use
    whatever the device; a forced one that cannot load raises. Falling back to the reference is
    never silent: it is logged as a warning with the reason."""
    forced = _forced(forced)
    if forced:
        logger.warning("ops: %s forced on device type %s", forced, device_type)
        ops = backend_class(forced)(device_type)
    elif use_kernels and device_type in DEVICE_KERNELS:
        kernels = DEVICE_KERNELS[device_type]
        try:
            ops = backend_class(kernels)(device_type)
        except Exception as e:  # no compiler, no headers, no torch_npu / CANN, ...
            logger.warning("ops: %s unavailable (%s: %s); running the pure-torch reference",
                           _KERNEL_NAMES[kernels],
                           type(e).__name__,
                           str(e).splitlines()[0][:200] if str(e) else "")
            ops = ReferenceOps(device_type)
    else:
        ops = ReferenceOps(device_type)
    logger.info("ops: %s implementation for %s", ops.describe(), device_type)
    return ops
