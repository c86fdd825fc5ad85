"""Shared test inputs for the paged attention ops: random q, caches with each sequence in scattered
blocks, cu_seqlens_q, seq_lens and -1 padded block tables; and the error measure every op test uses.
"""
import itertools

import torch

# The CUDA attention's tolerances (tests/test_cuda_ops.py, bench/cuda_attention.py): rel_err against
# the reference in float32 on the same (rounded) inputs.
CUDA_ATTENTION_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def rel_err(a, b):
    """max |a - b| / max |b|, in float32."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def rel_err_per_seq(a, b, cu_seqlens):
    """The worst sequence's rel_err, each over its own rows (cu_seqlens bounds them): every sequence
    is held to its own scale, so a long context's small outputs are not judged against a short
    context's large ones."""
    bounds = cu_seqlens.tolist()
    return max(rel_err(a[s:e], b[s:e]) for s, e in zip(bounds[:-1], bounds[1:]) if e > s)


def make_batch(q_lens, kv_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0,
               extra_width=1):
    """(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables); tables are extra_width blocks
    wider than the longest sequence needs, padded with -1."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(blocks) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, not contiguous, blocks
    tables = torch.full((len(kv_lens), max(blocks) + extra_width), -1, dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), tables


def fp32(args):
    return [a.float() if a.is_floating_point() else a for a in args]
