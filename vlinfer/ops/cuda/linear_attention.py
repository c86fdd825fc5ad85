"""Linear attention of hybrid models on CUDA (ops/reference/linear_attention.py defines it) on our
Triton kernels (triton/linear_attention.py): the causal conv1d and the gated delta rule (decode
calls the recurrence, others the chunked WY form), prefill chunks and decodes of a step in one
launch each, the state updated in place in its slot.

CudaOps loads and checks the kernels the first time a linear-attention layer runs (a dense model
never compiles them). The rule, in one place (`kernel_takes_*`): a call runs a kernel when its
tensors fit (q, k, v or x float32 / bf16 / fp16, the recurrent state a contiguous float32 pool, the
conv state a contiguous pool); any other call runs the reference. A state dtype the kernel does not
take is said once at load (engine/cache_pool.py reads STATE_KERNEL_DTYPES)."""
import torch

from vlinfer.ops.cuda.loader import load_triton_module
from vlinfer.ops.reference import linear_attention as reference

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The kernel updates the recurrent state in place in float32 (a bf16 state runs the reference).
STATE_KERNEL_DTYPES = (torch.float32,)
CHECK_TOL = 1e-4  # the load-time check, float32: our blocks are not the reference's


def kernel_takes_delta_rule(q, k, v, state) -> bool:
    return (q.dtype == k.dtype == v.dtype and q.dtype in KERNEL_DTYPES
            and state.dtype in STATE_KERNEL_DTYPES and state.is_contiguous())


def kernel_takes_conv(x, weight, conv_state) -> bool:
    return (x.dim() == 2 and weight.shape[1] >= 2 and conv_state.is_contiguous()
            and all(t.dtype in KERNEL_DTYPES for t in (x, weight, conv_state)))


def graph_refusal(state_dtype: torch.dtype) -> str | None:
    """Why decode steps with a recurrent state of state_dtype cannot be captured in a CUDA graph
    (None: they can): the kernels read every step's metadata on the device, the reference on the
    host."""
    if state_dtype not in STATE_KERNEL_DTYPES:
        return (f"the Triton delta rule takes a float32 recurrent state; a {state_dtype} one runs "
                "the reference, which reads lengths on the host")
    return None


def checked_kernels(device: torch.device):
    """The kernels' module, after tiny float32 calls of each against the reference: a mixed call
    of three sequences (a decode, a prefill from zeros, a chunk after a carried state) in scrambled
    slots, then a decode call (the delta rule's recurrent kernel). Surfaces a Triton that cannot
    compile or computes wrong here."""
    module = load_triton_module("linear_attention")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 12, generator=g), torch.randn(12, 4, generator=g)
    conv_state = torch.randn(4, 12, 3, generator=g)
    q, k = torch.randn(9, 1, 8, generator=g), torch.randn(9, 1, 8, generator=g)
    v, state = torch.randn(9, 2, 8, generator=g), torch.randn(4, 2, 8, 8, generator=g)
    decay, beta = -torch.rand(9, 2, generator=g), torch.rand(9, 2, generator=g)
    x, w, conv_state, q, k, v, state, decay, beta = (
        t.to(device) for t in (x, w, conv_state, q, k, v, state, decay, beta))
    slots = torch.tensor([2, 0, 3], device=device)
    has = torch.tensor([True, False, True], device=device)
    pairs = []
    for bounds in ([0, 1, 6, 9], [0, 1, 2, 3]):
        cu, n = torch.tensor(bounds, device=device), bounds[-1]
        for op, args in ((module.causal_conv1d, (x[:n], w, None)),
                         (module.gated_delta_rule, (q[:n], k[:n], v[:n], decay[:n], beta[:n]))):
            pool = conv_state if op is module.causal_conv1d else state
            ours_pool, ref_pool = pool.clone(), pool.clone()
            tail = (cu, slots, has) + ((0.5,) if op is module.gated_delta_rule else ())
            ref_op = getattr(reference, op.__name__)
            pairs += [(op(*args, ours_pool, *tail), ref_op(*args, ref_pool, *tail)),
                      (ours_pool, ref_pool)]
    for ours, expected in pairs:
        err = ((ours - expected).abs().max() / expected.abs().max()).item()
        if not err < CHECK_TOL:
            raise RuntimeError(
                f"the Triton linear attention is off from the reference by {err:.3g}")
    return module


def gated_delta_rule(kernels, q, k, v, g, beta, state, cu_seqlens, slots, has_state, scale):
    if kernels is None or not kernel_takes_delta_rule(q, k, v, state):
        return reference.gated_delta_rule(q, k, v, g, beta, state, cu_seqlens, slots, has_state,
                                          scale)
    return kernels.gated_delta_rule(q, k, v, g, beta, state, cu_seqlens, slots, has_state, scale)


def causal_conv1d(kernels, x, weight, bias, conv_state, cu_seqlens, slots, has_state):
    if kernels is None or not kernel_takes_conv(x, weight, conv_state):
        return reference.causal_conv1d(x, weight, bias, conv_state, cu_seqlens, slots, has_state)
    return kernels.causal_conv1d(x, weight, bias, conv_state, cu_seqlens, slots, has_state)
