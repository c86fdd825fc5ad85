"""The fused MoE op on CPU: two grouped GEMMs over the (token, slot) pairs sorted by expert.

Same result as ops/reference/moe.py fused_moe. Where the reference loops over the experts that got
tokens, this runs the whole layer as: route (float32 softmax, top-k, renormalize, cast back), one
stable argsort of the pairs by expert, a gather of their rows, `torch._grouped_mm` against every
expert's gate/up rows at once, SiLU-and-multiply, `torch._grouped_mm` against the down projections,
then the routing weights and the sum over each token's top-k. No Python loop over experts: a decode
step over 128 experts is a fixed handful of tensor ops.

Decode steps and small batches give each active expert a row or two: there the layer is a read of
every active expert's weights, and the op table's `expert_matmul` (csrc/moe_experts.cpp, bf16)
streams them at the memory's bandwidth where torch._grouped_mm does not; so up to SMALL_GROUP_ROWS
rows per active expert on average the kernel runs, above it the grouped GEMM (oneDNN, AMX tiles). In
float32 torch's grouped GEMM (MKL) already runs near the bandwidth.

bf16 on CPUs with AVX512-BF16 and no AMX packs each expert's weights once into 32-output panels
(pack_moe_weights with panels=True; csrc/moe_experts.cpp expert_panel_matmul) and runs every group
size on them, faster than both at decode and prefill. With AMX the grouped GEMM's oneDNN tiles keep
prefill, and the plain layout stays. bench/ops.py re-derives these choices (figures:
docs/benchmarks.md "Kernel decisions").

torch's CPU grouped GEMM needs every row stride to be a multiple of 16 bytes
(pytorch/pytorch#161717): hidden and intermediate sizes that are not (tiny test models) are padded
once with zeros at packing time, where zero gate and up rows give silu(0) * 0 = 0 and zero down
columns add nothing, so the padding changes no value."""
import torch
import torch.nn.functional as F

from vlinfer.ops.cpu.panels import PANEL, plain_shape, to_panels
from vlinfer.ops.reference.moe import check_moe_shapes, route

STRIDE_BYTES = 16  # torch._grouped_mm's CPU alignment rule for row strides
# rows per active expert up to which expert_matmul beats the grouped GEMM (see above)
SMALL_GROUP_ROWS = 3


def _aligned(size: int, dtype: torch.dtype, step_bytes: int = STRIDE_BYTES) -> int:
    step = max(1, step_bytes // torch.empty((), dtype=dtype).element_size())
    return -(-size // step) * step


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor, panels: bool = False):
    """(w13, w2) padded to grouped-GEMM-aligned hidden / intermediate sizes, or None when they
    already are; with panels (bf16 only), padded so that every projection has whole 32-output panels
    and pairs of k, then packed into expert_panel_matmul's [E, N / 32, K / 2, 32, 2] layout."""
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    panels = panels and w13.dtype == torch.bfloat16
    # Panels: w2's outputs (hidden) in whole panels, w13's 2 * inter too; every k (hidden, inter)
    # even.
    hidden_p = _aligned(hidden, w13.dtype, PANEL * 2 if panels else STRIDE_BYTES)
    inter_p = _aligned(inter, w13.dtype, PANEL if panels else STRIDE_BYTES)
    if (hidden_p, inter_p) != (hidden, inter):
        w13_p = w13.new_zeros(num_experts, 2 * inter_p, hidden_p)
        w13_p[:, :inter, :hidden] = w13[:, :inter]  # gate rows
        w13_p[:, inter_p:inter_p + inter, :hidden] = w13[:, inter:]  # up rows
        w2_p = w2.new_zeros(num_experts, hidden_p, inter_p)
        w2_p[:, :hidden, :inter] = w2
        w13, w2 = w13_p, w2_p
    elif not panels:
        return None
    if panels:
        return to_panels(w13), to_panels(w2)
    return w13, w2


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool, expert_offset: int = 0, silu_and_mul=None,
              expert_matmul=None, expert_panel_matmul=None) -> torch.Tensor:
    """ops/reference/moe.py fused_moe on w13 / w2 as loaded or as pack_moe_weights padded or packed
    them. silu_and_mul: the op table's kernel for the activation (the reference's by default);
    expert_matmul: the op table's small-group kernel for bf16 (None: the grouped GEMM always);
    expert_panel_matmul: the kernel for panel-packed weights (5-D), which then runs every group."""
    tokens, hidden = x.shape
    if w13.dim() == 5:  # panels: [E, N / 32, K / 2, 32, 2]
        if expert_panel_matmul is None or x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16:
            raise ValueError(
                f"fused_moe: panel-packed experts run only in bfloat16 on expert_panel_matmul (x "
                f"{x.dtype}, weights {w13.dtype}, kernel "
                f"{'given' if expert_panel_matmul else 'none'})"
            )
        _check_padded(x, router_logits, plain_shape(w13), plain_shape(w2), expert_offset,
                      panels=True)
    elif w13.dim() == 3 and w13.shape[2] == hidden:  # as loaded (not padded)
        check_moe_shapes(x, router_logits, w13, w2, expert_offset)
        padded = pack_moe_weights(w13, w2)
        # sizes the grouped GEMM cannot take, never packed: padded for this call
        if padded is not None:
            w13, w2 = padded
    else:
        _check_padded(x, router_logits, w13.shape, w2.shape, expert_offset, panels=False)
    num_local, _, hidden_p = plain_shape(w13) if w13.dim() == 5 else w13.shape
    weights, ids = route(router_logits, top_k, renormalize, x.dtype)
    out = x.new_zeros(tokens, hidden)
    local_ids = ids.flatten() - expert_offset  # one entry per (token, slot) pair, token-major
    if num_local < router_logits.shape[1]:  # expert parallel: only this rank's experts' pairs
        pairs = ((local_ids >= 0) & (local_ids < num_local)).nonzero().squeeze(1)
        local_ids = local_ids[pairs]
    else:
        pairs = None
    if local_ids.numel():
        order = local_ids.argsort(stable=True)
        sorted_pairs = order if pairs is None else pairs[order]
        counts = torch.bincount(local_ids, minlength=num_local)
        offs = counts.cumsum(0).to(torch.int32)
        rows = x[sorted_pairs // top_k]
        if hidden_p != hidden:
            rows = F.pad(rows, (0, hidden_p - hidden))
        if w13.dim() == 5:
            matmul = expert_panel_matmul
        elif expert_matmul is not None and x.dtype == torch.bfloat16 and w13.is_contiguous() and \
                w2.is_contiguous() and \
                local_ids.numel() <= SMALL_GROUP_ROWS * int((counts > 0).sum()):
            matmul = expert_matmul
        else:
            matmul = _grouped_matmul
        gate_up = matmul(rows, w13, offs)
        act = silu_and_mul(gate_up) if silu_and_mul is not None else _silu_and_mul(gate_up)
        down = matmul(act, w2, offs)
        if hidden_p != hidden:
            down = down[:, :hidden]
        # In place and straight into the [T, H] result, in the reference's order (by expert): a
        # prefill's [T * k, H] temporaries are fresh pages from the OS on every step (large
        # allocations are mmapped), and their page faults cost more than the arithmetic (a 16K-pair
        # step: ~20 ms each).
        down.mul_(weights.flatten()[sorted_pairs, None])
        out.index_add_(0, sorted_pairs // top_k, down)
    return out


def _grouped_matmul(rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert times their expert's [N, K] weight, transposed (the expert_matmul
    contract)."""
    return torch._grouped_mm(rows, w.transpose(-2, -1), offs=offs)


def _check_padded(x, router_logits, w13: torch.Size, w2: torch.Size, expert_offset: int,
                  panels: bool) -> None:
    """[E, N, K] shapes of the weights pack_moe_weights padded (or packed into panels), against the
    activations; raises naming the mismatch."""
    hidden = x.shape[1]
    hidden_p = _aligned(hidden, x.dtype, PANEL * 2 if panels else STRIDE_BYTES)
    ok = (len(w13) == 3 and len(w2) == 3 and w13[2] == hidden_p and w13[1] % 2 == 0
          and tuple(w2) == (w13[0], w13[2], w13[1] // 2) and router_logits.dim() == 2
          and router_logits.shape[0] == x.shape[0])
    if not ok:
        raise ValueError(
            f"fused_moe: w13 {tuple(w13)}, w2 {tuple(w2)} (padded for the grouped GEMM) do "
            f"not fit x {tuple(x.shape)} and router_logits {tuple(router_logits.shape)}")
    if expert_offset < 0 or expert_offset + w13[0] > router_logits.shape[1]:
        raise ValueError(
            f"fused_moe: local experts [{expert_offset}, {expert_offset + w13[0]}) are outside "
            f"the {router_logits.shape[1]} routed experts")


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up
