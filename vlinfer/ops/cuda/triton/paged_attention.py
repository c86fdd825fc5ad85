"""Paged attention for CUDA in Triton: prefill chunks, prefix hits and single-token decodes of one
step in one launch, over the paged cache [num_blocks, block_size, kv_heads, head_dim] through each
sequence's block table, in the reference's causal rule (a chunk's queries are its sequence's last
tokens). The cache may hold the compute dtype or a compressed one (kv_cache_dtype,
ops/reference/kv_cache.py): half precision and fp8 with one scale per layer, int8 with one scale per
row; rows are read, scaled and accumulated in float32.

One program per (tile of BLOCK_M query tokens of one sequence, KV head): the tile's tokens times the
GROUP query heads of that KV head form the rows of one matrix, so a KV head's keys and values are
read once for all its query heads. It walks its sequence's blocks up to the tile's last causal
position with an online softmax. Which sequence a tile belongs to comes from a prefix sum of tiles
per sequence made on the device, and the grid is an upper bound known from shapes alone (tokens /
BLOCK_M + sequences; programs past the last tile return), so the launch takes no host sync and a
CUDA graph can capture it.

Loaded by file path by vlinfer/ops/cuda/loader.py (triton/ is not a package); tests run it under
the Triton interpreter.
"""
import torch
import triton
import triton.language as tl

SCALE_NONE, SCALE_PER_TENSOR, SCALE_PER_ROW = 0, 1, 2

# Reductions through tl.reduce with triton's own combines, not tl.max / tl.sum: those are jit
# helpers the interpreter cannot run when triton was imported before TRITON_INTERPRET was set, and
# the interpreter reduces these two combines with numpy (a combine of our own it runs element by
# element in Python).


@triton.jit
def _load_rows(ptr, scale_ptr, offsets, row_index, mask, row_mask, SCALE_MODE: tl.constexpr,
               FP8: tl.constexpr):
    """Cache rows as float32, their scale applied. fp8 caches arrive as uint8 and are bitcast here.
    """
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
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr,
                            cu_q_ptr, seq_lens_ptr, tables_ptr, cu_tiles_ptr, num_seqs, q_stride_t,
                            q_stride_h, out_stride_t, out_stride_h, out_stride_s, table_stride,
                            scale, blocks_per_split, BLOCK_SIZE: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
                            NUM_KV_HEADS: tl.constexpr, SCALE_MODE: tl.constexpr, FP8: tl.constexpr,
                            IEEE: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr,
                            NUM_SPLITS: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if tile >= tl.load(cu_tiles_ptr + num_seqs):
        return
    # The tile's sequence: how many sequences start at or before it (cu_tiles is non-decreasing).
    seq = 0
    for s in range(1, num_seqs):
        seq += (tl.load(cu_tiles_ptr + s) <= tile).to(tl.int32)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if PAGED:
        kv_len = tl.load(seq_lens_ptr + seq)
    else:  # keys are the segment's own rows of k / v (the vision tower's packed images)
        kv_len = q_len
    first = (tile - tl.load(cu_tiles_ptr + seq)) * BLOCK_M

    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    token = first + rows // BLOCK_G
    g = rows % BLOCK_G
    row_valid = (token < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + token).to(tl.int64)[:, None] * q_stride_t + head[:, None] * q_stride_h +
        dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0).to(tl.float32)
    position = kv_len - q_len + token  # causal: each query sees keys 0..position
    if CAUSAL:
        last = tl.minimum(kv_len - q_len + first + BLOCK_M - 1, kv_len - 1)
    else:
        last = kv_len - 1
    # This program's blocks: all of them, or its split's share (flash-decoding; combined by
    # _combine_splits).
    lo = split * blocks_per_split
    hi = tl.minimum(last // BLOCK_SIZE + 1, lo +
                    blocks_per_split) if NUM_SPLITS > 1 else last // BLOCK_SIZE + 1

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    for j in range(lo, hi):
        key_pos = j * BLOCK_SIZE + offs
        key_valid = key_pos < kv_len
        if PAGED:
            block = tl.load(tables_ptr + seq * table_stride + j).to(tl.int64)
            slot = block * BLOCK_SIZE + offs
        else:
            slot = (q_start + key_pos).to(tl.int64)
        offsets = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
        mask = key_valid[:, None] & dim_valid[None, :]
        row_index = slot * NUM_KV_HEADS + kv_head
        k = _load_rows(k_ptr, k_scale_ptr, offsets, row_index, mask, key_valid, SCALE_MODE, FP8)
        v = _load_rows(v_ptr, v_scale_ptr, offsets, row_index, mask, key_valid, SCALE_MODE, FP8)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        if CAUSAL:
            allowed = (key_pos[None, :] <= position[:, None]) & key_valid[None, :]
        else:
            allowed = key_valid[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        # rows with no key yet (or none at all)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = (q_start + token).to(tl.int64)[:, None] * out_stride_t + head[:, None] * out_stride_h
    # this split's normalized output and its log-sum-exp (-inf: no key in the split)
    if NUM_SPLITS > 1:
        out_rows += split * out_stride_s
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(
            lse_ptr + ((q_start + token).to(tl.int64) *
                       (NUM_KV_HEADS * GROUP) + head) * NUM_SPLITS + split, lse, mask=row_valid)
    tl.store(out_ptr + out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _combine_splits(part_ptr, lse_ptr, out_ptr, part_stride_t, part_stride_h, out_stride_t,
                    out_stride_h, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """One (token, head): the splits' outputs weighted by exp(lse - max lse); zeros where no split
    saw a key."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + (token * NUM_HEADS + head) * NUM_SPLITS + splits)
    top = tl.reduce(lse, 0, tl.standard._elementwise_max)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top)
    part = tl.load(
        part_ptr + token * part_stride_t + head * part_stride_h + splits[:, None] * BLOCK_D +
        dims[None, :], mask=dims[None, :] < HEAD_DIM, other=0.0)
    total = tl.reduce(weight, 0, tl.standard._sum_combine)
    out = tl.reduce(part * weight[:, None], 0, tl.standard._sum_combine) / tl.where(
        total > 0, total, 1.0)
    tl.store(out_ptr + token * out_stride_t + head * out_stride_h + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _scale_mode(cache: torch.Tensor, scale: torch.Tensor | None) -> int:
    if scale is None:
        return SCALE_NONE
    return SCALE_PER_ROW if cache.dtype == torch.int8 else SCALE_PER_TENSOR


# Split-KV (flash-decoding) for decode steps with few (sequence, KV head) programs: each split walks
# a share of the block table's static width, so the split count follows from shapes alone (a CUDA
# graph captures it).
# decode steps with fewer (sequence, KV head) programs than this split their keys
SPLIT_MAX_PROGRAMS = 256
SPLIT_TOKENS = 512  # keys per split, at least
MAX_SPLITS = 16


def num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, table_width: int,
               block_size: int) -> int:
    """Splits of each sequence's keys: 1 but for a decode step (one token per sequence) with few
    programs and a table wide enough; from shapes only."""
    if num_tokens != num_seqs or num_seqs * num_kv_heads >= SPLIT_MAX_PROGRAMS:
        return 1
    splits = min(MAX_SPLITS, table_width * block_size // SPLIT_TOKENS)
    # a power of two: the combine's tl.arange
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1


def _tiles(cu_seqlens_q: torch.Tensor, block_m: int) -> torch.Tensor:
    """Each sequence's first query tile, and the total (int32 [S + 1]), on the device."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    tiles = torch.div(q_lens + block_m - 1, block_m, rounding_mode="floor")
    return torch.nn.functional.pad(tiles.cumsum(0), (1, 0)).to(torch.int32)


def _attention(q, k, v, cu_seqlens_q, seq_lens, block_tables, scale, k_scale, v_scale, causal: bool,
               splits: int) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    paged = block_tables is not None
    block_size = k.shape[1] if paged else 32
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_m = max(1, 16 // block_g)
    block_d = max(16, triton.next_power_of_2(head_dim))
    cu_tiles = _tiles(cu_seqlens_q, block_m)
    fp8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}.get(k.dtype, 0)
    if fp8:  # loaded as bytes and bitcast in the kernel
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    if q.stride(2) != 1:
        q = q.contiguous()
    dummy = cu_tiles  # an unused pointer (scales, lse, tables)
    width = block_tables.shape[1] if paged else 1
    part, lse = out, dummy
    if splits > 1:  # each split's output and log-sum-exp, combined below
        part = torch.empty(num_tokens, num_heads, splits, block_d, dtype=torch.float32,
                           device=q.device)
        lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    grid = (num_tokens // block_m + num_seqs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        q, k, v, dummy if k_scale is None else k_scale, dummy if v_scale is None else v_scale, part,
        lse, cu_seqlens_q.to(torch.int32), dummy if seq_lens is None else seq_lens.to(torch.int32),
        block_tables.to(torch.int32) if paged else dummy, cu_tiles, num_seqs, q.stride(0),
        q.stride(1), part.stride(0), part.stride(1), part.stride(2) if splits > 1 else 0,
        block_tables.stride(0) if paged else 0, scale, -(-width // splits), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_G=block_g, BLOCK_M=block_m,
        NUM_KV_HEADS=num_kv_heads, SCALE_MODE=_scale_mode(k, k_scale), FP8=fp8,
        IEEE=q.dtype == torch.float32, CAUSAL=causal, PAGED=paged, NUM_SPLITS=splits)
    if splits > 1:
        _combine_splits[(num_tokens, num_heads)](part, lse, out, part.stride(0), part.stride(1),
                                                 out.stride(0), out.stride(1), NUM_HEADS=num_heads,
                                                 HEAD_DIM=head_dim, BLOCK_D=block_d,
                                                 NUM_SPLITS=splits)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """reference.paged_attention's contract (quantized_paged_attention's with k_scale / v_scale): q
    [T, heads, D] -> [T, heads, D] in q's dtype. splits: split-KV programs per sequence (None:
    num_splits' choice)."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} do not match")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"paged_attention: block size {block_size} (a power of two >= 16 is needed)")
    if splits is None:
        splits = num_splits(num_tokens, seq_lens.shape[0], num_kv_heads, block_tables.shape[1],
                            block_size)
    return _attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, k_scale,
                      v_scale, True, splits)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """reference.varlen_attention's contract: bidirectional attention within each packed segment
    (the vision tower's images and frames), q / k / v [T, heads, D], every segment in one launch."""
    if not q.shape == k.shape == v.shape:
        raise ValueError(
            f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} differ")
    return _attention(q, k.contiguous(), v.contiguous(), cu_seqlens, None, None, scale, None, None,
                      False, 1)
