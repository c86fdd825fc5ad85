"""Picks each op's implementation for the engine's device once, at start-up, and logs the choice. The only
place that knows which device implementation runs."""
import logging
import os

from vlinfer.ops import reference

logger = logging.getLogger("vlinfer")

OPS = ("store_kvcache", "paged_attention", "apply_rotary", "rms_norm", "add_rms_norm", "silu_and_mul",
       "gelu_tanh", "varlen_attention", "linear")
# VLINFER_OPS=<name> forces one implementation whatever the device, e.g. the NPU code on CPU tensors under an
# emulated torch_npu (tests/fake_torch_npu.py). A forced implementation that cannot load is an error, not a fallback.
OVERRIDE_ENV = "VLINFER_OPS"
IMPLEMENTATIONS = ("cuda", "npu", "cpu-compiled", "reference")
# The implementation each device type gets by default; other device types run the reference.
DEVICE_KERNELS = {"cpu": "cpu-compiled", "npu": "npu", "cuda": "cuda"}
_KERNEL_NAMES = {"cpu-compiled": "compiled CPU kernels", "npu": "torch_npu kernels", "cuda": "CUDA kernels"}


class _Active:
    name = "reference"
    impl = {op: getattr(reference, op) for op in OPS}
    prepare_weights = None  # the implementation's one-time weight preparation (e.g. a kernel's layout), if any


active = _Active()


def _load(name: str, device_type: str):
    """The implementation module called name, loaded for device_type; raises when it cannot load."""
    if name == "cpu-compiled":
        from vlinfer.ops import cpu
        cpu.load()
        return cpu
    if name == "cuda":
        from vlinfer.ops import cuda
        cuda.load(device_type)
        return cuda
    from vlinfer.ops import npu
    npu.load(device_type)
    return npu


def select(device_type: str, use_kernels: bool = True) -> str:
    """Install the implementation for device_type; returns its name. Falling back to the reference is never
    silent: it is logged as a warning with the reason. Ops a module does not define stay on the reference."""
    impl, name, prepare = {op: getattr(reference, op) for op in OPS}, "reference", None
    forced = os.environ.get(OVERRIDE_ENV, "").strip()
    if forced:
        if forced not in IMPLEMENTATIONS:
            raise ValueError(f"{OVERRIDE_ENV}={forced!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
        logger.warning("ops: %s=%s forces the %s implementation on device type %s", OVERRIDE_ENV, forced, forced,
                       device_type)
        if forced != "reference":
            module = _load(forced, device_type)
            impl.update({op: getattr(module, op) for op in OPS if hasattr(module, op)})
            name, prepare = module.NAME, getattr(module, "prepare_weights", None)
    elif use_kernels and device_type in DEVICE_KERNELS:
        kernels = DEVICE_KERNELS[device_type]
        try:
            module = _load(kernels, device_type)
            impl.update({op: getattr(module, op) for op in OPS if hasattr(module, op)})
            name, prepare = module.NAME, getattr(module, "prepare_weights", None)
        except Exception as e:  # no compiler, no headers, no torch_npu / CANN, ...
            logger.warning("ops: %s unavailable (%s: %s); running the pure-torch reference", _KERNEL_NAMES[kernels],
                           type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
    active.impl, active.name, active.prepare_weights = impl, name, prepare
    logger.info("ops: %s implementation for %s", name, device_type)
    return name


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    return active.impl["store_kvcache"](key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    return active.impl["paged_attention"](q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)


def apply_rotary(q, k, cos, sin):
    return active.impl["apply_rotary"](q, k, cos, sin)


def rms_norm(x, weight, eps):
    return active.impl["rms_norm"](x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return active.impl["add_rms_norm"](x, residual, weight, eps)


def silu_and_mul(x):
    return active.impl["silu_and_mul"](x)


def gelu_tanh(x):
    return active.impl["gelu_tanh"](x)


def varlen_attention(q, k, v, cu_seqlens, scale):
    return active.impl["varlen_attention"](q, k, v, cu_seqlens, scale)


def linear(x, weight, bias=None):
    return active.impl["linear"](x, weight, bias)


def prepare_weights(model) -> None:
    """Let the selected implementation convert the loaded model's weights to the layout its kernels want; called
    once by the model runner after loading, on every rank."""
    if active.prepare_weights is not None:
        active.prepare_weights(model)
