"""The fused mixture-of-experts op, in pure torch: the definition every device implementation must
match.

    fused_moe(x, router_logits, w13, w2, top_k, renormalize, expert_offset=0) -> out
      x [T, H]; router_logits [T, E_total] (any float dtype: the softmax runs in float32, as
      transformers');
      w13 [E_local, 2*I, H]: gate rows then up rows of each local expert; w2 [E_local, H, I];
      renormalize: divide the top-k weights by their sum (Qwen3's norm_topk_prob);
      expert_offset: global id of local expert 0. Under expert parallelism a rank holds experts
      [expert_offset, expert_offset + E_local); a token's share of a non-local expert contributes
      zero here and the
      caller all-reduces across ranks.
      out [T, H] = sum over the token's top-k experts e of weight_e * down_e(silu(gate_e x) * up_e
      x), with the
      routing weights cast back to x.dtype before they scale the expert outputs (transformers does
      the same).

The steps are the ones every implementation follows: route, group the (token, slot) pairs by expert,
two grouped matmuls with SwiGLU between, weighted sum over the top-k. The grouping here is a loop
over the experts that received tokens; device implementations replace it with grouped GEMMs."""
import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype):
    """(weights [T, k] in dtype, expert ids [T, k] int64): float32 softmax, top-k, optional
    renormalization, cast back, as transformers' Qwen3-MoE / Qwen3-VL-MoE routers compute them."""
    if top_k < 1 or top_k > router_logits.shape[-1]:
        raise ValueError(
            f"fused_moe: top_k={top_k} must be in 1..{router_logits.shape[-1]} (the number of "
            "experts)"
        )
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def check_moe_shapes(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, expert_offset: int) -> None:
    """Raises a ValueError naming the mismatch; every implementation calls it before running."""
    if x.dim() != 2 or router_logits.dim() != 2 or router_logits.shape[0] != x.shape[0]:
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)} and router_logits {tuple(router_logits.shape)} must be "
            "[T, H] and [T, E]")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        raise ValueError(
            f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2I, H] and "
            "[E, H, I]"
        )
    num_local, two_i, hidden = w13.shape
    if hidden != x.shape[1] or two_i % 2 or tuple(w2.shape[1:]) != (hidden, two_i // 2):
        raise ValueError(
            f"fused_moe: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit x "
            f"{tuple(x.shape)}: "
            "expected [E, 2I, H] and [E, H, I]")
    if expert_offset < 0 or expert_offset + num_local > router_logits.shape[1]:
        raise ValueError(
            f"fused_moe: local experts [{expert_offset}, {expert_offset + num_local}) are outside "
            "the "
            f"{router_logits.shape[1]} routed experts")


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool, expert_offset: int = 0) -> torch.Tensor:
    check_moe_shapes(x, router_logits, w13, w2, expert_offset)
    weights, ids = route(router_logits, top_k, renormalize, x.dtype)
    out = torch.zeros_like(x)
    local_ids = ids - expert_offset
    num_local = w13.shape[0]
    for e in torch.unique(local_ids).tolist():
        if e < 0 or e >= num_local:  # another rank's expert: contributes zero here
            continue
        token_idx, slot = torch.where(local_ids == e)
        gate, up = F.linear(x[token_idx], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor):
    """The reference runs on the weights as loaded: no device layout."""
    return None
