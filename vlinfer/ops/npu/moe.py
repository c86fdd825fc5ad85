"""The fused MoE op on torch_npu's MoE operators (NpuOps.fused_moe), ops/reference/moe.py
fused_moe's contract:

1. npu_moe_gating_top_k_softmax on the float32 logits (softmax, top-k; it does not renormalize, so
   that is done
   here in float32, then the weights are cast to x's dtype, as transformers computes them);
2. npu_moe_init_routing_v2 (dropless, unquantized, counts per expert of active_expert_range,
   gather-form row index:
   the destination row of each flat source row t*K + k), as vllm-ascend's AllGather dispatcher calls
   it;
3. npu_grouped_matmul over the rows grouped by expert (group_type 0, counts as group_list_type 1),
   npu_swiglu,
   npu_grouped_matmul again. The weights are passed as w13 / w2 transposed views ([E, H, 2I] / [E,
   I, H], the
   documented "weight transposed" form): no copy at load;
4. npu_moe_finalize_routing (drop_pad_mode 2: dropless, the row index by row) for the weighted sum
   over the top-k.

Contracts: Ascend/op-plugin's torch_npu API pages (tests/fakes/fake_torch_npu_moe.py emulates them).
Nothing here has run on an NPU. Nothing reads a value back to the host, so a decode graph can
capture it.

Expert parallel (a rank holds experts [expert_offset, expert_offset + E_local) of E_total):
init_routing_v2 groups only the pairs of local experts, at the front; grouped_matmul needs its group
sizes to add up to its rows, so the other pairs' rows (invalid data, per the routing page) are
zeroed and counted into the last local group: they cost the compute of those pairs but give zeros.
Their weights are zero and finalize reads them at the last row, which is one of the zeroed rows
whenever any pair is non-local. Every pair is computed (as on one rank): EP here saves expert
memory, not expert FLOPs."""
import torch

from vlinfer.ops.reference import moe as moe_reference

MAX_GROUPS = 1024  # npu_grouped_matmul: groups of one split-M call


def fused_moe(torch_npu, x, router_logits, w13, w2, top_k: int, renormalize: bool,
              expert_offset: int = 0):
    moe_reference.check_moe_shapes(x, router_logits, w13, w2, expert_offset)
    num_tokens, hidden = x.shape
    num_total, num_local = router_logits.shape[1], w13.shape[0]
    if not 1 <= top_k <= num_total:
        raise ValueError(
            f"fused_moe: top_k={top_k} must be in 1..{num_total} (the number of experts)")
    if num_local > MAX_GROUPS:
        raise ValueError(
            f"fused_moe on NPU: {num_local} local experts; npu_grouped_matmul takes at most "
            f"{MAX_GROUPS} groups")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(
            f"fused_moe on NPU: x {x.dtype} and the expert weights {w13.dtype} / {w2.dtype} must "
            "share "
            "a dtype (npu_grouped_matmul)")
    if num_tokens == 0:
        return torch.empty_like(x)
    weights, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(router_logits.float(), None, k=top_k)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    parallel = expert_offset != 0 or num_local != num_total
    if parallel:  # another rank's experts contribute zero here
        weights = weights * ((ids >= expert_offset) & (ids < expert_offset + num_local))
    weights = weights.to(x.dtype)
    num_pairs = num_tokens * top_k
    rows, src_to_dst, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x.contiguous(), ids, active_num=num_pairs, expert_num=num_total, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[expert_offset,
                                                          expert_offset + num_local], quant_mode=-1)
    if parallel:
        local_pairs = counts.sum()
        rows = torch.where((torch.arange(num_pairs, device=x.device) < local_pairs)[:, None], rows,
                           0)
        counts = counts.clone()
        counts[-1] += num_pairs - local_pairs
        src_to_dst = torch.where(src_to_dst >= 0, src_to_dst, num_pairs - 1).to(torch.int32)
    gmm = dict(group_list=counts.to(torch.int64), split_item=2, group_type=0, group_list_type=1)
    gate_up = torch_npu.npu_grouped_matmul([rows], [w13.transpose(1, 2)], **gmm)[0]
    act = torch_npu.npu_swiglu(gate_up, -1)
    down = torch_npu.npu_grouped_matmul([act], [w2.transpose(1, 2)], **gmm)[0]
    return torch_npu.npu_moe_finalize_routing(down, None, None, None, weights, src_to_dst, None,
                                              drop_pad_mode=2)
