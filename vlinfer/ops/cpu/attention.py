"""Attention on the CPU beside the kernels CpuOps calls: which rows of a step decode
(`decode_rows`), and prefill chunks over a cached context through torch's flash-attention CPU kernel
(`chunk_over_context`).

A chunk of n queries over kv_len keys, the first kv_len - n of them cached, sees the whole context
and its own n keys causally. Given to SDPA as one call with an explicit mask, the kernel computes
all n x kv_len scores and skips none (a mask is data to it); the masked half of the last n x n
square is wasted work, and the mask itself is read for every score. Here the chunk is two calls
instead, the context without a mask and the chunk's own keys with is_causal (which skips the masked
blocks), merged by their log-sum-exps: softmax over the union of two key sets is each part's output
weighted by exp(its lse - the union's lse). The merge is exact up to float32 rounding.
reference.prefill_attention walks a step's chunks and calls chunk_over_context for those with a
context.

torch's public SDPA returns no log-sum-exp; `aten._scaled_dot_product_flash_attention_for_cpu` is
the op it dispatches to on the CPU and returns (output, logsumexp), grouped-query heads included.
"""
import torch


def _flash_with_lse(q, k, v, causal: bool, scale: float):
    """q [heads, n, d], k / v [kv_heads, s, d] -> output [heads, n, d] and logsumexp [heads, n]
    (float32)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, scale=scale)[:2]
    return out[0], lse[0]


def chunk_over_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [heads, n, d]: the last n of kv_len positions; k / v [kv_heads, kv_len, d] -> [heads, n,
    d]."""
    context = k.shape[1] - q.shape[1]
    o_context, lse_context = _flash_with_lse(q, k[:, :context], v[:, :context], False, scale)
    o_chunk, lse_chunk = _flash_with_lse(q, k[:, context:], v[:, context:], True, scale)
    lse = torch.logaddexp(lse_context, lse_chunk)
    w_context = (lse_context - lse).exp_().unsqueeze(-1)
    w_chunk = (lse_chunk - lse).exp_().unsqueeze(-1)
    return (o_context.float() * w_context + o_chunk.float() * w_chunk).to(q.dtype)


def decode_rows(cu_seqlens_q: torch.Tensor) -> torch.Tensor | None:
    """Indices of the sequences that bring one query token this step; None when every one does."""
    decode = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]) == 1
    return None if bool(decode.all()) else decode.nonzero().squeeze(1)
