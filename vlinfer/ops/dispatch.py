"""Picks each op's implementation for the engine's device once, at start-up, and logs the choice. The only
place that knows which device implementation runs."""
import logging

from vlinfer.ops import reference

logger = logging.getLogger("vlinfer")

OPS = ("store_kvcache", "paged_attention", "apply_rotary")


class _Active:
    name = "reference"
    impl = {op: getattr(reference, op) for op in OPS}


active = _Active()


def select(device_type: str, use_kernels: bool = True) -> str:
    """Install the implementation for device_type; returns its name. Falling back to the reference is never
    silent: it is logged as a warning with the reason."""
    impl, name = {op: getattr(reference, op) for op in OPS}, "reference"
    if use_kernels and device_type == "cpu":
        from vlinfer.ops import cpu
        try:
            cpu.load()
            impl.update({op: getattr(cpu, op) for op in OPS})
            name = cpu.NAME
        except Exception as e:  # no compiler, no headers, ...
            logger.warning("ops: compiled CPU kernels unavailable (%s: %s); running the pure-torch reference",
                           type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
    active.impl, active.name = impl, name
    logger.info("ops: %s implementation for %s", name, device_type)
    return name


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    return active.impl["store_kvcache"](key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    return active.impl["paged_attention"](q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)


def apply_rotary(q, k, cos, sin):
    return active.impl["apply_rotary"](q, k, cos, sin)
