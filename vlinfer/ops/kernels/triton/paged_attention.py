"""Paged attention for CUDA in Triton: prefill chunks, prefix hits and single-token decodes of one step in one launch,
over the paged cache [num_blocks, block_size, kv_heads, head_dim] through each sequence's block table, in the
reference's causal rule (a chunk's queries are its sequence's last tokens). The cache may hold the compute dtype or a
compressed one (kv_cache_dtype, ops/kv_quant_reference.py): half precision and fp8 with one scale per layer, int8
with one scale per row; rows are read, scaled and accumulated in float32.

One program per (tile of BLOCK_M query tokens of one sequence, KV head): the tile's tokens times the GROUP query heads
of that KV head form the rows of one matrix, so a KV head's keys and values are read once for all its query heads.
It walks its sequence's blocks up to the tile's last causal position with an online softmax. Which sequence a tile
belongs to comes from a prefix sum of tiles per sequence made on the device, and the grid is an upper bound known
from shapes alone (tokens / BLOCK_M + sequences; programs past the last tile return), so the launch takes no host
sync and a CUDA graph can capture it.

Loaded by file path from vlinfer/ops/cuda.py (kernels/ is not a package); tests run it under the Triton interpreter.
"""
import torch
import triton
import triton.language as tl

SCALE_NONE, SCALE_PER_TENSOR, SCALE_PER_ROW = 0, 1, 2


# No jit helpers of triton.language (tl.max, tl.sum, tl.zeros): the interpreter cannot run those when triton was
# imported before TRITON_INTERPRET was set (kernels/triton/int8_gemm.py says the same); our own combines instead.
@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _load_rows(ptr, scale_ptr, offsets, row_index, mask, row_mask, SCALE_MODE: tl.constexpr,
               FP8: tl.constexpr):
    """Cache rows as float32, their scale applied. fp8 caches arrive as uint8 and are bitcast here."""
    x = tl.load(ptr + offsets, mask=mask, other=0)
    if FP8 == 1:
        x = x.to(tl.float8e4nv, bitcast=True)
    if FP8 == 2:
        x = x.to(tl.float8e5, bitcast=True)
    x = x.to(tl.float32)
    if SCALE_MODE == 1:
        x = x * tl.load(scale_ptr)
    if SCALE_MODE == 2:
        x = x * tl.load(scale_ptr + row_index, mask=row_mask, other=0.0)[:, None]
    return x


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                            cu_q_ptr, seq_lens_ptr, tables_ptr, cu_tiles_ptr, num_seqs,
                            q_stride_t, q_stride_h, out_stride_t, out_stride_h, table_stride, scale,
                            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
                            NUM_KV_HEADS: tl.constexpr, SCALE_MODE: tl.constexpr, FP8: tl.constexpr,
                            IEEE: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if tile >= tl.load(cu_tiles_ptr + num_seqs):
        return
    # The tile's sequence: how many sequences start at or before it (cu_tiles is non-decreasing).
    seq = 0
    for s in range(1, num_seqs):
        seq += (tl.load(cu_tiles_ptr + s) <= tile).to(tl.int32)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    kv_len = tl.load(seq_lens_ptr + seq)
    first = (tile - tl.load(cu_tiles_ptr + seq)) * BLOCK_M

    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    token = first + rows // BLOCK_G
    g = rows % BLOCK_G
    row_valid = (token < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token).to(tl.int64)[:, None] * q_stride_t + head[:, None] * q_stride_h
                + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0).to(tl.float32)
    position = kv_len - q_len + token  # each query sees keys 0..position
    last = tl.minimum(kv_len - q_len + first + BLOCK_M - 1, kv_len - 1)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    for j in range(0, last // BLOCK_SIZE + 1):
        block = tl.load(tables_ptr + seq * table_stride + j).to(tl.int64)
        key_pos = j * BLOCK_SIZE + offs
        key_valid = key_pos < kv_len
        slot = block * BLOCK_SIZE + offs
        offsets = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
        mask = key_valid[:, None] & dim_valid[None, :]
        row_index = slot * NUM_KV_HEADS + kv_head
        k = _load_rows(k_ptr, k_scale_ptr, offsets, row_index, mask, key_valid, SCALE_MODE, FP8)
        v = _load_rows(v_ptr, v_scale_ptr, offsets, row_index, mask, key_valid, SCALE_MODE, FP8)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        allowed = (key_pos[None, :] <= position[:, None]) & key_valid[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _maximum))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet (or none at all)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, _add)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + token).to(tl.int64)[:, None] * out_stride_t + head[:, None] * out_stride_h
             + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def _scale_mode(cache: torch.Tensor, scale: torch.Tensor | None) -> int:
    if scale is None:
        return SCALE_NONE
    return SCALE_PER_ROW if cache.dtype == torch.int8 else SCALE_PER_TENSOR


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """reference.paged_attention's contract (quantized_paged_attention's with k_scale / v_scale): q [T, heads, D]
    -> [T, heads, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} do not match")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"paged_attention: block size {block_size} (a power of two >= 16 is needed)")
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_m = max(1, 16 // block_g)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    tiles = torch.div(q_lens + block_m - 1, block_m, rounding_mode="floor")
    cu_tiles = torch.nn.functional.pad(tiles.cumsum(0), (1, 0)).to(torch.int32)
    fp8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}.get(k_cache.dtype, 0)
    if fp8:  # loaded as bytes and bitcast in the kernel
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if q.stride(2) != 1:
        q = q.contiguous()
    dummy = cu_tiles  # an unused scale pointer
    grid = (num_tokens // block_m + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, dummy if k_scale is None else k_scale, dummy if v_scale is None else v_scale, out,
        cu_seqlens_q.to(torch.int32), seq_lens.to(torch.int32), block_tables.to(torch.int32), cu_tiles, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), scale,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), GROUP=group,
        BLOCK_G=block_g, BLOCK_M=block_m, NUM_KV_HEADS=num_kv_heads, SCALE_MODE=_scale_mode(k_cache, k_scale),
        FP8=fp8, IEEE=q.dtype == torch.float32)
    return out
