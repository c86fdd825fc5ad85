"""What attention over the paged KV cache means (paged_attention, and over a cache stored in another
dtype, quantized_paged_attention) and the vision tower's packed bidirectional attention
(varlen_attention), in pure torch. Device kernels must match these."""
import torch
import torch.nn.functional as F

from vlinfer.ops.reference import kv_cache


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous [length, kv_heads, head_dim] view of one sequence's paged KV."""
    num_blocks = (length + cache.shape[1] - 1) // cache.shape[1]
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of packed queries q [T, heads, head_dim] over each sequence's paged KV.

    Sequence i owns queries cu_seqlens_q[i]:cu_seqlens_q[i+1], which are its last tokens: query j of
    a chunk of length n sits at absolute position seq_lens[i] - n + j and sees keys 0..that
    position. Any mix of prefill chunks (with or without a cached prefix) and single-token decodes
    is valid in one call.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    kv_lens = seq_lens.tolist()
    decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
    if decode_rows:
        # Single-token queries batch into one padded call: [B, kv_heads, group, D] against [B,
        # kv_heads, L, D]. Explicit matmuls beat SDPA here (its CPU kernel is tuned for long
        # queries); softmax runs in float32.
        rows = torch.tensor(decode_rows, device=q.device)
        block_size = k_cache.shape[1]
        max_len = max(kv_lens[i] for i in decode_rows)
        max_blocks = (max_len + block_size - 1) // block_size
        length = max_blocks * block_size
        flat = block_tables[rows, :max_blocks].clamp_min(0).flatten()
        b = len(decode_rows)
        k = k_cache.index_select(0, flat).view(b, length, num_kv_heads,
                                               head_dim).transpose(1, 2).contiguous()
        v = v_cache.index_select(0, flat).view(b, length, num_kv_heads,
                                               head_dim).transpose(1, 2).contiguous()
        token_index = cu_seqlens_q[rows]
        qd = q[token_index].view(b, num_kv_heads, group, head_dim)
        scores = torch.matmul(qd, k.transpose(-1, -2)).float().mul_(scale)
        beyond = torch.arange(length, device=q.device)[None, :] >= seq_lens[rows][:, None]
        scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
        # Padding slots may hold uninitialized memory (NaN): zero weight times NaN would still be
        # NaN.
        v = v.masked_fill(beyond[:, None, :, None], 0)
        o = torch.matmul(scores.softmax(-1).to(v.dtype), v)
        out[token_index] = o.reshape(b, num_heads, head_dim)
    prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out)
    return out


def quantized_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              k_scale: torch.Tensor, v_scale: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                              block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_attention over a cache stored in another dtype than q's (kv_cache.py says how it
    reads): the blocks the tables name are read back in q's dtype and attended as a cache of the
    compute dtype."""
    k, v, tables = kv_cache.dequantized_blocks(k_cache, v_cache, k_scale, v_scale, block_tables,
                                               q.dtype)
    return paged_attention(q, k, v, cu_seqlens_q, seq_lens, tables, scale)


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out,
                      chunk_over_context=None) -> None:
    """The multi-token rows of paged_attention (prefill chunks), one causal call per sequence,
    written to out. chunk_over_context(q [heads, n, d], k, v [kv_heads, kv_len, d], scale): how a
    chunk after a cached context is attended where an op table has a faster way than the masked call
    below (ops/cpu/attention.py)."""
    group = q.shape[1] // k_cache.shape[2]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    starts = cu_seqlens_q[:-1].tolist()
    kv_lens = seq_lens.tolist()
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        kv_len = kv_lens[i]
        k = _gather_kv(k_cache, block_tables[i], kv_len).transpose(0, 1)
        v = _gather_kv(v_cache, block_tables[i], kv_len).transpose(0, 1)
        qs = q[starts[i]:starts[i] + n].transpose(0, 1)
        # no cached context: plain causal, which lets SDPA skip the masked half of the blocks
        if n == kv_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale,
                                               enable_gqa=group > 1)
        elif chunk_over_context is not None:
            o = chunk_over_context(qs, k, v, scale)
        else:
            # Query j may see keys up to kv_len - n + j: a causal mask shifted by the cached
            # context.
            q_pos = torch.arange(kv_len - n, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=group > 1)
        out[starts[i]:starts[i] + n] = o.transpose(0, 1)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Bidirectional attention within each packed segment: q, k, v [T, heads, head_dim], segments
    cu_seqlens."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        o = F.scaled_dot_product_attention(q[start:end].transpose(0,
                                                                  1), k[start:end].transpose(0, 1),
                                           v[start:end].transpose(0, 1), scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
