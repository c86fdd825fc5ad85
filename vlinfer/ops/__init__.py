"""The op interface layers call. Device implementations (kernels/) plug in here; today every op is the
pure-torch reference."""
from vlinfer.ops.reference import (add_rms_norm, apply_rotary, paged_attention, rms_norm, silu_and_mul,
                                   store_kvcache, varlen_attention)

__all__ = ["add_rms_norm", "apply_rotary", "paged_attention", "rms_norm", "silu_and_mul", "store_kvcache",
           "varlen_attention"]
