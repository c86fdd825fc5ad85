"""Linear attention of hybrid models on the CPU (ops/reference/linear_attention.py defines it) on
our kernels: decode calls (one token per sequence) on csrc/linear_attention.cpp, which reads each
state once per step; prefill chunks and mixed calls on csrc/linear_attention_prefill.cpp, the
chunked form in blocks of the reference's CHUNK tokens (a one-token sequence is a block of one).

The rule, in one place (`kernel_takes_*`): a call runs a kernel when its tensors fit: q, k, v (or
x, the conv weight and conv state) float32 or bf16 with unit stride along the last dim, the
recurrent state a contiguous float32 pool, the conv state a contiguous pool; any other call runs
the reference. `is_decode` then picks the decode kernel (the decode kernel checks cu_seqlens is
0..B and refuses a call that hides a zero-length sequence behind a longer one)."""
import torch

from vlinfer.ops.reference import linear_attention as reference

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# The recurrent state the delta-rule kernel reads and writes: float32 only (a bf16 state runs the
# reference, which computes in float32 and stores back in the state's dtype).
STATE_KERNEL_DTYPES = (torch.float32,)


def is_decode(tokens: int, cu_seqlens: torch.Tensor) -> bool:
    """One token per sequence (no host sync: the kernel checks the boundaries themselves)."""
    return tokens == cu_seqlens.shape[0] - 1


def kernel_takes_delta_rule(q, k, v, state) -> bool:
    return (q.dtype == k.dtype == v.dtype and q.dtype in KERNEL_DTYPES
            and state.dtype in STATE_KERNEL_DTYPES and state.is_contiguous()
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1)


def kernel_takes_conv(x, weight, conv_state) -> bool:
    return (x.dim() == 2 and x.stride(-1) == 1
            and all(t.dtype in KERNEL_DTYPES for t in (x, weight, conv_state))
            and weight.is_contiguous() and weight.shape[1] >= 2 and conv_state.is_contiguous())


def gated_delta_rule(ext, q, k, v, g, beta, state, cu_seqlens, slots, has_state, scale):
    if not kernel_takes_delta_rule(q, k, v, state):
        return reference.gated_delta_rule(q, k, v, g, beta, state, cu_seqlens, slots, has_state,
                                          scale)
    if is_decode(q.shape[0], cu_seqlens):
        return ext.gated_delta_rule_decode(q, k, v, g, beta, state, cu_seqlens, slots, has_state,
                                           scale)
    return ext.gated_delta_rule_prefill(q, k, v, g, beta, state, cu_seqlens, slots, has_state,
                                        scale, reference.CHUNK)


def causal_conv1d(ext, x, weight, bias, conv_state, cu_seqlens, slots, has_state):
    if not kernel_takes_conv(x, weight, conv_state):
        return reference.causal_conv1d(x, weight, bias, conv_state, cu_seqlens, slots, has_state)
    entry = ext.causal_conv1d_decode if is_decode(x.shape[0], cu_seqlens) else \
        ext.causal_conv1d_prefill
    return entry(x, weight, bias, conv_state, cu_seqlens, slots, has_state)
