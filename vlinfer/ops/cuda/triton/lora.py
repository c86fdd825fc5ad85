"""LoRA for CUDA in Triton: vlinfer/ops/reference/'s add_lora as punica's SGMV pair, a shrink kernel
and an expand kernel over the step's rows grouped by adapter slot (layers/lora.py LoRAGroups: rows
sorted by slot, offsets[s] the start of slot s's segment).

1. shrink: each program takes one slot (grid axis 1), a block of BLOCK_M rows of that slot's segment
   and a block of
   BLOCK_R of the rank dimension R (axis 0), and one of SPLIT_K slices of the input dimension (axis
   2): the rows of
   x it gathers (row = rows[p], or p when every row runs the one adapter) times that slot's A,
   accumulated in float32
   into shrink[p, r] (atomically when split: decode steps have few rows per slot, so K is split to
   fill the GPU).
2. expand: each program takes one slot, a block of its rows and a block of BLOCK_N outputs: shrink
   rounded to the
   weights' dtype (the reference rounds it to x's) times that slot's B, added in float32 to y's rows
   in place.
   Each token has one slot, so no two programs write one element of y.

Programs whose row block lies past their slot's segment exit at once: the grid is sized from the
longest segment (max_rows, known on the host), slots with no rows cost an empty program each.
Nothing reads a value back.

Loaded by file path by vlinfer/ops/cuda/loader.py (triton/ is not a package). Runs on CPU tensors
under the Triton interpreter (TRITON_INTERPRET=1 set before this file is loaded), which is how
tests/ops/test_lora_ops.py checks it. The kernels call no jit helpers (tl.zeros, tl.cdiv): the
interpreter cannot run those when triton was imported before TRITON_INTERPRET was set, so zeros come
from tl.full and block counts from the host.
"""
import os

import torch
import triton
import triton.language as tl

# Triton's interpreter computes tl.dot on bfloat16 tiles wrongly (fused_moe.py), so under it bf16
# tiles, and only those, are widened to float32 first; on a GPU 16-bit tiles go to the tensor cores
# as they are. Read when this file is loaded.
WIDEN_FOR_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, rows_ptr, offsets_ptr, hidden, rank, num_r, stride_xm,
                   stride_as, stride_ar, stride_om, HAS_ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr, WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    pid_k = tl.program_id(2)
    pid_m = pid // num_r
    pid_r = pid % num_r
    start = tl.load(offsets_ptr + slot)
    end = tl.load(offsets_ptr + slot + 1)
    if start + pid_m * BLOCK_M >= end:
        return
    pos = (start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pos < end
    if HAS_ROWS:
        token = tl.load(rows_ptr + pos, mask=valid, other=0).to(tl.int64)
    else:
        token = pos
    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    ks = tl.arange(0, BLOCK_K)
    # This program's K slices: pid_k, pid_k + SPLIT_K, ... (blocks of BLOCK_K). A[slot] is [R,
    # hidden] row-major: a [K, R] tile reads its rows by stride.
    x_ptrs = x_ptr + token[:, None] * stride_xm + (pid_k * BLOCK_K + ks)[None, :]
    a_ptrs = a_ptr + slot * stride_as + rs[None, :] * stride_ar + (pid_k * BLOCK_K + ks)[:, None]
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(pid_k * BLOCK_K, hidden, BLOCK_K * SPLIT_K):
        k_ok = ks < hidden - k0
        a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:  # float32 models: full-precision products, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * SPLIT_K
        a_ptrs += BLOCK_K * SPLIT_K
    out_ptrs = out_ptr + pos[:, None] * stride_om + rs[None, :]
    out_mask = valid[:, None] & r_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, rows_ptr, offsets_ptr, out_features, rank, num_n, stride_sm,
                   stride_bs, stride_bn, stride_ym, HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                   WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    pid_m = pid // num_n
    pid_n = pid % num_n
    start = tl.load(offsets_ptr + slot)
    end = tl.load(offsets_ptr + slot + 1)
    if start + pid_m * BLOCK_M >= end:
        return
    pos = (start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pos < end
    if HAS_ROWS:
        token = tl.load(rows_ptr + pos, mask=valid, other=0).to(tl.int64)
    else:
        token = pos
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < out_features
    rs = tl.arange(0, BLOCK_R)
    # B[slot] is [out, R] row-major: an [R, N] tile reads its rows by stride.
    s_ptrs = s_ptr + pos[:, None] * stride_sm + rs[None, :]
    b_ptrs = b_ptr + slot * stride_bs + ns[None, :] * stride_bn + rs[:, None]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r_ok = rs < rank - r0
        b = tl.load(b_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        a = tl.load(s_ptrs, mask=valid[:, None] & r_ok[None, :], other=0.0).to(b.dtype)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        s_ptrs += BLOCK_R
        b_ptrs += BLOCK_R
    y_ptrs = y_ptr + token[:, None] * stride_ym + ns[None, :]
    y_mask = valid[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def block_config(max_rows: int, hidden: int, rank: int) -> dict:
    """Tile sizes and the shrink's K split. Untuned heuristics in punica's spirit: small row blocks
    for decode-sized segments, K split while few row blocks would leave the GPU idle. Powers of two,
    at least 16 (tl.dot)."""
    block_m = 16 if max_rows <= 16 else (32 if max_rows <= 64 else 64)
    block_r = min(64, max(16, triton.next_power_of_2(rank)))
    block_k = 64
    split_k = 1 if max_rows > 256 else max(1, min(8, hidden // (4 * block_k)))
    return dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k, BLOCK_N=64)


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             rows: torch.Tensor | None, offsets: torch.Tensor, max_rows: int,
             config: dict | None = None):
    """y[rows[p]] += (x[rows[p]] @ lora_a[s].T) @ lora_b[s].T for p in [offsets[s], offsets[s + 1])
    of every slot s < len(offsets) - 1 (rows None: row p itself), in place. x [T, in], y [T, out],
    lora_a [L, R, in], lora_b [L, out, R]; max_rows: the longest segment."""
    num_slots = offsets.numel() - 1
    num_rows = x.shape[0] if rows is None else rows.numel()
    if max_rows == 0 or num_slots == 0:
        return y
    hidden, rank, out_features = x.shape[1], lora_a.shape[1], y.shape[1]
    cfg = config or block_config(max_rows, hidden, rank)
    # The kernels step the reduction dims with unit stride, and write y's rows in place.
    x = x if x.stride(1) == 1 else x.contiguous()
    lora_a = lora_a if lora_a.stride(2) == 1 else lora_a.contiguous()
    lora_b = lora_b if lora_b.stride(2) == 1 else lora_b.contiguous()
    target = y if y.stride(1) == 1 else y.contiguous()
    ieee = x.dtype == torch.float32
    widen = WIDEN_FOR_INTERPRETER and x.dtype == torch.bfloat16
    shrink = torch.zeros(num_rows, rank, dtype=torch.float32, device=x.device)
    num_m = triton.cdiv(max_rows, cfg["BLOCK_M"])
    num_r = triton.cdiv(rank, cfg["BLOCK_R"])
    _shrink_kernel[(num_m * num_r, num_slots,
                    cfg["SPLIT_K"])](x, lora_a, shrink, rows if rows is not None else offsets,
                                     offsets, hidden, rank, num_r, x.stride(0), lora_a.stride(0),
                                     lora_a.stride(1), shrink.stride(0), HAS_ROWS=rows is not None,
                                     SPLIT_K=cfg["SPLIT_K"], BLOCK_M=cfg["BLOCK_M"],
                                     BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"], IEEE=ieee,
                                     WIDEN=widen)
    num_n = triton.cdiv(out_features, cfg["BLOCK_N"])
    _expand_kernel[(num_m * num_n,
                    num_slots)](shrink, lora_b, target, rows if rows is not None else offsets,
                                offsets, out_features, rank, num_n, shrink.stride(0),
                                lora_b.stride(0), lora_b.stride(1), target.stride(0), HAS_ROWS=rows
                                is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                BLOCK_R=cfg["BLOCK_R"], IEEE=ieee, WIDEN=widen)
    if target is not y:
        y.copy_(target)
    return y
