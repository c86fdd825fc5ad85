"""The fused MoE op for CUDA: our Triton kernels (triton/fused_moe.py) behind ops/reference/moe.py
fused_moe's contract. Routing (float32 softmax, top-k, renormalize, cast back) runs as torch ops on
the device, as the reference computes it; the kernels do the grouped GEMMs, the SwiGLU and the
weighted sum.

CudaOps loads and checks the kernels the first time an MoE layer asks (pack_moe_weights at load, or
the first fused_moe call; loader.TritonKernels), not at engine start: a dense model pays nothing for
them. A Triton that is missing or fails the check is a warning, and the op runs the reference (a
Python loop over the experts that received tokens, with a host sync: no CUDA graphs for such a
model)."""
import torch

from vlinfer.ops.cuda.loader import load_triton_module
from vlinfer.ops.reference import moe as moe_reference


def load_kernel():
    """triton/fused_moe.py as a module, loaded afresh."""
    return load_triton_module("fused_moe")


def checked_kernel(device: torch.device):
    """The kernels' fused_experts, after one tiny problem against the reference, all experts local
    and expert-parallel (a non-local expert among the routed ones): surfaces a Triton that cannot
    compile or computes wrong here, at load (CudaOps loads it through loader.TritonKernels)."""
    fused_experts = load_kernel().fused_experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=g).to(device)
    logits = torch.randn(3, 3, generator=g).to(device)
    w13 = torch.randn(3, 32, 32, generator=g).to(device) / 6
    w2 = torch.randn(3, 32, 16, generator=g).to(device) / 4
    for local, offset in ((slice(0, 3), 0), (slice(1, 3), 1)):
        expected = moe_reference.fused_moe(x, logits, w13[local], w2[local], 2, True, offset)
        ours = fused_moe(fused_experts, x, logits, w13[local], w2[local], 2, True, offset)
        err = ((ours - expected).abs().max() / expected.abs().max()).item()
        if not err < 1e-4:
            raise RuntimeError(f"the Triton fused MoE is off from the reference by {err:.3g}")
    return fused_experts


def fused_moe(fused_experts, x, router_logits, w13, w2, top_k: int, renormalize: bool,
              expert_offset: int = 0):
    """moe_reference.fused_moe's contract on the Triton kernels."""
    moe_reference.check_moe_shapes(x, router_logits, w13, w2, expert_offset)
    weights, ids = moe_reference.route(router_logits, top_k, renormalize, x.dtype)
    return fused_experts(x, w13, w2, weights, ids, expert_offset)
