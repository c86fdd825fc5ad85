"""Fused mixture-of-experts for CUDA in Triton: vlinfer/ops/reference/moe.py's fused_moe as two
grouped GEMMs over the (token, slot) pairs sorted by expert, in the design of vLLM's fused_moe
kernel (the pairs of each expert padded to a multiple of BLOCK_M, so that every M-block of the
sorted list belongs to one expert):

1. align (torch, on the device, no host sync): the flat pair ids t * top_k + j grouped by local
   expert, each group
   padded with the sentinel T * top_k to a multiple of BLOCK_M; one expert id per M-block. Pairs
   routed to another
   rank's experts (expert parallel) form one more group whose blocks carry expert -1.
2. gate_up kernel: for each M-block and N-block of the expert width I, the block's rows of x (row =
   pair // top_k)
   times that expert's gate rows and up rows, two accumulators, and silu(gate) * up written once:
   the activation
   is fused into the first GEMM's epilogue, so the [pairs, 2I] product never reaches memory.
3. down kernel: the activation rows times the expert's down projection, scaled by the pair's routing
   weight, written
   to the pair's row of [T * top_k, H]; blocks of expert -1 write zeros (their pairs contribute
   nothing here).
4. the sum over each token's top_k rows.

Loaded by file path by vlinfer/ops/cuda/loader.py (triton/ is not a package). Runs on CPU
tensors under the Triton interpreter (TRITON_INTERPRET=1 set before this file is loaded), which is
how tests/ops/test_moe_ops.py checks it without a GPU. Every step takes no device->host sync and
allocates by shapes known on the host (the grid is sized for the worst case and blocks past the
padded length exit at once), so a CUDA graph can capture it.
"""
import os

import torch
import triton
import triton.language as tl

# Triton 3.8's interpreter computes tl.dot on bfloat16 operands wrongly (values off by ~1e10;
# float32 and float16 operands are right), so under the interpreter bf16 tiles, and only those, are
# widened to float32 first (tests/ops/test_moe_ops.py checks the interpreter still needs it). On a
# GPU the tiles stay in the model dtype for the tensor cores. Read when this file is loaded, as
# triton reads TRITON_INTERPRET.
WIDEN_FOR_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


def block_config(num_pairs: int, num_experts: int, hidden: int, inter: int) -> dict:
    """Tile sizes. Few pairs per expert (decode): small M-blocks, so padding each expert's handful
    of rows to the block wastes little; many (prefill, batches): 64-row blocks that reuse each
    loaded weight tile across rows. Untuned heuristics in vLLM's spirit (its defaults without a
    tuned JSON); powers of two, at least 16 (tl.dot)."""
    per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 48 else 64)
    return dict(BLOCK_M=block_m, BLOCK_N=min(64, max(16, triton.next_power_of_2(min(hidden,
                                                                                    inter)))),
                BLOCK_K=min(64, max(16, triton.next_power_of_2(min(hidden, inter)))))


def align_block_size(topk_ids: torch.Tensor, block_m: int, num_local: int, expert_offset: int):
    """(sorted_pair_ids int32 [padded], block_experts int32 [padded // block_m], num_padded int32
    [1]).

    Pairs of local expert e (global id expert_offset + e) come first in expert order, each group
    padded with the sentinel num_pairs; then the pairs of non-local experts, whose blocks carry
    expert -1. At most min(num_pairs, num_local + 1) groups are non-empty, each padded by < block_m:
    that bounds the length on the host, so nothing here reads a value back."""
    device = topk_ids.device
    flat = topk_ids.flatten().to(torch.int64)
    num_pairs = flat.numel()
    local = flat - expert_offset
    groups = num_local + 1  # the last one: experts of other ranks
    group = torch.where((local >= 0) & (local < num_local), local,
                        torch.full_like(local, num_local))
    counts = torch.zeros(groups, dtype=torch.int64,
                         device=device).scatter_add_(0, group, torch.ones_like(group))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(group, stable=True)
    in_group = group[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[in_group]
    position = (padded_end - padded)[in_group] + rank
    length = num_pairs + min(num_pairs, groups) * (block_m - 1)
    length = (length + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((length,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[position] = order.to(torch.int32)
    block_start = torch.arange(0, length, block_m, device=device)
    block_group = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_group < num_local, block_group,
                                torch.full_like(block_group, -1))
    return sorted_ids, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, act_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
                    num_pairs, inter, hidden, num_n, stride_xm, stride_we, stride_wn, stride_act,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:  # another rank's expert: the down kernel writes these pairs' zeros
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows).to(tl.int64)
    valid = pair < num_pairs
    token = pair // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    # w13[e] is [2I, H] row-major: gate row n at n, up row n at inter + n; a [K, N] tile reads rows
    # by stride.
    w_base = w13_ptr + expert * stride_we
    gate_ptrs = w_base + cols[None, :] * stride_wn + ks[:, None]
    up_ptrs = w_base + (cols[None, :] + inter) * stride_wn + ks[:, None]
    x_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
    gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(gate_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        bu = tl.load(up_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if WIDEN:
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        if IEEE:  # float32 models: full-precision products, not TF32
            gate = tl.dot(a, bg, gate, input_precision="ieee")
            up = tl.dot(a, bu, up, input_precision="ieee")
        else:
            gate = tl.dot(a, bg, gate)
            up = tl.dot(a, bu, up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    act = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = act_ptr + pair[:, None] * stride_act + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ids_ptr, block_experts_ptr,
                 num_padded_ptr, num_pairs, hidden, inter, num_n, stride_act, stride_we, stride_wn,
                 stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows).to(tl.int64)
    valid = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    out_ptrs = out_ptr + pair[:, None] * stride_out + cols[None, :]
    out_mask = valid[:, None] & col_ok[None, :]
    if expert < 0:  # pairs of another rank's experts contribute zero on this one
        tl.store(out_ptrs, tl.full((BLOCK_M, BLOCK_N), 0.0, out_ptr.dtype.element_ty),
                 mask=out_mask)
        return
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pair[:, None] * stride_act + ks[None, :]
    # w2[e] is [H, I] row-major
    b_ptrs = w2_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_offset: int = 0,
                  config: dict | None = None) -> torch.Tensor:
    """out [T, H] = sum over j of topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e =
    topk_ids[t, j] - expert_offset when that is a local expert (0 <= e < E_local), zero otherwise. x
    [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I]; topk_weights [T, k] (x's dtype, as the
    reference scales by them); topk_ids [T, k] global expert ids. Shapes are checked by the caller
    (moe_reference.check_moe_shapes); ids are trusted."""
    num_tokens, hidden = x.shape
    num_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    out = x.new_empty(num_tokens, hidden)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    cfg = config or block_config(num_pairs, num_local, hidden, inter)
    # The kernels step K with unit stride: the reduction dims must be contiguous.
    x = x if x.stride(1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    sorted_ids, block_experts, num_padded = align_block_size(topk_ids, cfg["BLOCK_M"], num_local,
                                                             expert_offset)
    num_m = sorted_ids.numel() // cfg["BLOCK_M"]
    ieee = x.dtype == torch.float32
    widen = WIDEN_FOR_INTERPRETER and x.dtype == torch.bfloat16
    act = x.new_empty(num_pairs, inter)
    # Grid: M-blocks times N-blocks, N fastest (neighbouring programs share the block's rows of x).
    # The kernels call no jit helpers (tl.cdiv, tl.zeros): the interpreter cannot run those when
    # triton was imported before TRITON_INTERPRET was set, so the N-block counts come from the host
    # and zeros from tl.full.
    num_n = triton.cdiv(inter, cfg["BLOCK_N"])
    _gate_up_kernel[(num_m * num_n, )](x, w13, act, sorted_ids, block_experts, num_padded,
                                       num_pairs, inter, hidden, num_n, x.stride(0), w13.stride(0),
                                       w13.stride(1), act.stride(0), TOP_K=top_k,
                                       BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                       BLOCK_K=cfg["BLOCK_K"], IEEE=ieee,
                                       WIDEN=widen)
    pair_out = x.new_empty(num_pairs, hidden)
    weights = topk_weights.to(x.dtype).contiguous().view(-1)
    num_n = triton.cdiv(hidden, cfg["BLOCK_N"])
    _down_kernel[(num_m * num_n, )](act, w2, pair_out, weights, sorted_ids, block_experts,
                                    num_padded, num_pairs, hidden, inter, num_n, act.stride(0),
                                    w2.stride(0), w2.stride(1), pair_out.stride(0),
                                    BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                    BLOCK_K=cfg["BLOCK_K"], IEEE=ieee, WIDEN=widen)
    # Every pair row was written (a local expert's product or a non-local pair's zeros): the sum
    # reads no garbage.
    torch.sum(pair_out.view(num_tokens, top_k, hidden), dim=1, out=out)
    return out
