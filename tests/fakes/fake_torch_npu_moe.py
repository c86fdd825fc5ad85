"""The emulated torch_npu's MoE operators (registered on FakeTorchNpu by
tests/fakes/fake_torch_npu.py).

Written from the documented contracts, not from vlinfer/ops/reference/moe.py: the torch_npu API
pages of Ascend/op-plugin (npu_moe_gating_top_k_softmax, npu_moe_init_routing_v2,
npu_moe_finalize_routing) and the MoE research note's kernel section (npu_grouped_matmul, which LoRA
calls too, is in tests/fakes/fake_torch_npu.py, §2.11). Each op checks what its page states (dtypes,
shapes, the argument values "currently supported") and raises FakeNpuError on a call the device
would reject. Arithmetic is float32, cast to the documented output dtype.

Interpretations (the pages leave them open):
- init_routing_v2 sorts (expert id, flat row n*K + k) pairs stably: ties keep row order
  (keyValueSort).
- Rows of expanded_x past the in-range count are "invalid data": here NaN, so a caller that reads
  them is caught.
  Entries of the gather-form expanded_row_idx whose expert is outside active_expert_range are -1
  (vllm-ascend takes
  abs() of them before its unpermute, so they are negative on the device).
"""
import torch

from fake_torch_npu import HALF, _require

FLOATS = HALF + (torch.float32,)
MAX_GATING_K = 1024


def _gating_top_k_softmax(module, x, finished=None, k=1):
    """softmax(x, -1), top-k: y (x's dtype), expert_idx int32, row_idx int32 = arange(N*k).view(k,
    N).T."""
    _require(x.dim() in (2, 3), f"x must be 2-D or 3-D, got {x.dim()}-D")
    _require(x.dtype in FLOATS, f"x must be float16/bfloat16/float32, got {x.dtype}")
    _require(isinstance(k, int) and 0 < k <= x.shape[-1] and k <= MAX_GATING_K,
             f"k={k} must be in 1..min({x.shape[-1]}, {MAX_GATING_K})")
    if finished is not None:
        raise NotImplementedError("finished rows are not emulated")
    y, idx = torch.topk(torch.softmax(x.float(), -1), k, dim=-1)
    rows = x.shape[:-1].numel()
    row_idx = torch.arange(rows * k, dtype=torch.int32).view(k, rows).t().reshape(*x.shape[:-1], k)
    return y.to(x.dtype), idx.to(torch.int32), row_idx


def _init_routing_v2(module, x, expert_idx, *, scale=None, offset=None, active_num=-1,
                     expert_capacity=-1, expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                     expert_tokens_num_flag=False, quant_mode=0, active_expert_range=[],
                     row_idx_type=0):
    """Dropless, unquantized routing: (expanded_x [N*K, H], expanded_row_idx [N*K] int32, per-expert
    token counts int64 [end - start], expanded_scale float32 [N*K] (meaningless without scale))."""
    _require(x.dim() == 2 and x.dtype in FLOATS + (torch.int8, ),
             f"x must be 2-D fp16/bf16/fp32/int8 (N, H), got "
             f"{x.dtype} {tuple(x.shape)}")
    _require(
        expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0] and
        expert_idx.dtype == torch.int32,
        f"expert_idx must be int32 (N, K), got {expert_idx.dtype} {tuple(expert_idx.shape)}")
    rows, k = expert_idx.shape
    _require(
        active_num == rows * k,
        f"active_num must equal NUM_ROWS*K={rows * k} (currently checked), got "
        f"{active_num}")
    _require(drop_pad_mode == 0, "only drop_pad_mode=0 (dropless) is supported")
    _require(expert_tokens_num_type in (1, 2),
             "expert_tokens_num_type: only 1 (count) and 2 (key_value) are "
             "supported")
    _require(expert_tokens_num_flag is True, "expert_tokens_num_flag: only True is supported")
    _require(
        quant_mode in (-1, 1),
        "quant_mode: only -1 (none) and 1 (dynamic) are supported; 0 (the default, "
        "static) is not")
    if quant_mode == 1 or scale is not None or offset is not None or expert_tokens_num_type == 2:
        raise NotImplementedError("quantized routing and key_value counts are not emulated")
    _require(
        isinstance(expert_num, int) and 0 < expert_num <= 10240,
        f"expert_num={expert_num} out of [0, 10240]")
    _require(
        len(active_expert_range) == 2, "active_expert_range must be [expert_start, expert_end]")
    start, end = (int(v) for v in active_expert_range)
    _require(
        0 <= start < end <= expert_num,
        f"active_expert_range {active_expert_range} must satisfy 0 <= start < "
        f"end <= expert_num={expert_num}")
    _require(row_idx_type in (0, 1),
             f"row_idx_type must be 0 (gather) or 1 (scatter), got {row_idx_type}")
    ids = expert_idx.reshape(-1).long()
    _require(bool(((ids >= 0) & (ids < expert_num)).all()),
             "expert ids must lie in [0, expert_num)")
    # sorted_row_idx: flat rows n*K + k in expert order
    order = torch.sort(ids, stable=True).indices
    active = (ids[order] >= start) & (ids[order] < end)
    in_range = order[active]  # sorted by expert, so the active ones are one contiguous run
    available = in_range.numel()
    expanded_x = (torch.full((rows * k, x.shape[1]), float("nan"), dtype=x.dtype)
                  if x.dtype in FLOATS else torch.zeros(rows * k, x.shape[1], dtype=x.dtype))
    expanded_x[:available] = x[in_range // k]
    expanded_row_idx = torch.full((rows * k,), -1, dtype=torch.int32)
    if row_idx_type == 0:  # gather: the destination row of each source row
        expanded_row_idx[in_range] = torch.arange(available, dtype=torch.int32)
    else:  # scatter: the source row of each destination row
        expanded_row_idx[:available] = in_range.to(torch.int32)
    counts = torch.bincount(ids[(ids >= start) & (ids < end)] - start,
                            minlength=end - start).to(torch.int64)
    return expanded_x, expanded_row_idx, counts, torch.full((rows * k,), float("nan"))


def _finalize_routing(module, expanded_permuted_rows, skip1, skip2, bias, scales,
                      expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0):
    """out[i] = skip1 + skip2 + sum_k scales[i, k] * (rows[idx(i, k)] + bias[expert(i, k)]),
    dropless modes: idx(i, k) = expanded_src_to_dst_row[i + k*N] (mode 0, by column) or [i*K + k]
    (mode 2, by row)."""
    rows = expanded_permuted_rows
    _require(
        rows.dim() == 2 and rows.dtype in FLOATS,
        f"expanded_permuted_rows must be 2-D fp16/bf16/fp32, got "
        f"{rows.dtype} {tuple(rows.shape)}")
    if drop_pad_mode not in (0, 2):
        raise NotImplementedError("the drop-pad modes (1, 3) are not emulated")
    _require(scales is not None, "scales=None is not emulated")
    _require(
        scales.dim() == 2 and scales.dtype == rows.dtype,
        f"scales must be 2-D (NUM_ROWS, K) of the rows' dtype "
        f"{rows.dtype}, got {scales.dtype}")
    n, k = scales.shape
    _require(rows.shape[0] == n * k,
             f"expanded_permuted_rows has {rows.shape[0]} rows for NUM_ROWS*K={n * k}")
    idx = expanded_src_to_dst_row
    _require(idx.dim() == 1 and idx.numel() == n * k and idx.dtype == torch.int32,
             "expanded_src_to_dst_row must be int32 (NUM_ROWS*K,)")
    _require(bool(((idx >= 0) & (idx < n * k)).all()),
             f"expanded_src_to_dst_row values must lie in [0, {n * k - 1}] "
             "(dropless modes)")
    _require(skip2 is None or skip1 is not None, "skip2 needs skip1")
    for t, name in ((skip1, "skip1"), (skip2, "skip2")):
        _require(t is None or (t.shape == (n, rows.shape[1]) and t.dtype == rows.dtype),
                 f"{name} must be (N, H)")
    if bias is not None:
        raise NotImplementedError("expert bias is not emulated")
    # [N, K] destination rows
    per_slot = idx.view(k, n).t() if drop_pad_mode == 0 else idx.view(n, k)
    out = (rows.float()[per_slot.long()] * scales.float()[..., None]).sum(1)
    for t in (skip1, skip2):
        if t is not None:
            out = out + t.float()
    return out.to(rows.dtype)


MOE_OPS = {
    "npu_moe_gating_top_k_softmax": _gating_top_k_softmax,
    "npu_moe_init_routing_v2": _init_routing_v2, "npu_moe_finalize_routing": _finalize_routing
}
