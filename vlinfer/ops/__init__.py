"""The op interface layers call. `dispatch.select(device)` installs a device implementation at engine start-up;
reference.py is the pure-torch definition of every op (and the implementation when no kernel applies)."""
from vlinfer.ops.dispatch import (add_rms_norm, apply_rotary, gelu_tanh, linear, paged_attention, prepare_weights,
                                  rms_norm, select, silu_and_mul, store_kvcache, varlen_attention)

__all__ = ["add_rms_norm", "apply_rotary", "gelu_tanh", "linear", "paged_attention", "prepare_weights", "rms_norm",
           "select", "silu_and_mul", "store_kvcache", "varlen_attention"]
