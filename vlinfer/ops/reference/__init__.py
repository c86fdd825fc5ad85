"""The semantic spec: every op's pure-torch definition, one file per op family (attention, kv_cache,
linear, norm, activation, rotary, quant, gguf, moe, lora, bitmask, linear_attention). Device kernels
are tested against these. `ReferenceOps` (backend.py) is the op table built from them; the
definitions are re-exported here, so `reference.paged_attention` names the definition wherever it
lives."""
from vlinfer.ops.reference.activation import gelu_tanh, silu_and_mul
from vlinfer.ops.reference.attention import (paged_attention, prefill_attention,
                                             quantized_paged_attention, varlen_attention)
from vlinfer.ops.reference.backend import ReferenceOps
from vlinfer.ops.reference.kv_cache import store_kvcache, store_quantized_kvcache
from vlinfer.ops.reference.linear import linear
from vlinfer.ops.reference.lora import add_lora
from vlinfer.ops.reference.norm import add_rms_norm, rms_norm
from vlinfer.ops.reference.rotary import apply_rotary, rotate_half

__all__ = ["ReferenceOps", "add_lora", "add_rms_norm", "apply_rotary", "gelu_tanh", "linear",
           "paged_attention", "prefill_attention", "quantized_paged_attention", "rms_norm",
           "rotate_half", "silu_and_mul", "store_kvcache", "store_quantized_kvcache",
           "varlen_attention"]
