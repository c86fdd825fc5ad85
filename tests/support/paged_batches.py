"""Shared test inputs for the paged attention ops: random q, caches with each sequence in scattered
blocks, cu_seqlens_q, seq_lens and -1 padded block tables; the error measure every attention test
uses (per sequence, never one batch-wide max); and the negative control each attention suite runs.
"""
import itertools

import torch

from vlinfer.ops import reference

# The CUDA attention's tolerances (tests/ops/cuda/test_cuda_ops.py, bench/cuda_attention.py):
# rel_err against the reference in float32 on the same (rounded) inputs.
CUDA_ATTENTION_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def rel_err(a, b):
    """max |a - b| / max |b|, in float32: for one sequence's rows, or an op whose rows are not
    sequences (a norm, a linear); attention outputs take rel_err_per_seq."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def rel_err_per_seq(a, b, cu_seqlens=None):
    """The worst sequence's rel_err, each over its own rows (cu_seqlens bounds them; None: each row
    is a sequence, a decode batch): every sequence is held to its own scale, so a long context's
    small outputs are not judged against a short context's large ones."""
    if cu_seqlens is None:
        cu_seqlens = torch.arange(a.shape[0] + 1)
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


def short_reads(attention, args, scale, block_size):
    """Negative control: the errors (per sequence, then batch-wide) of `attention(q, k, v, cu,
    seq_lens, tables, scale)` run with the longest sequence (a decode) one key short, then one block
    short, against the reference over the true lengths: what a kernel that drops the last key or a
    block returns. Each per-sequence error must fail the suite's tolerance."""
    q, k_cache, v_cache, cu, lens, tables = args
    ref = reference.paged_attention(*fp32(args), scale)
    longest = int(lens.argmax())
    assert lens[longest] > block_size and cu[longest + 1] - cu[longest] == 1
    errors = []
    for short in (1, block_size):
        wrong = lens.clone()
        wrong[longest] -= short
        out = attention(q, k_cache, v_cache, cu, wrong, tables, scale)
        errors.append((rel_err_per_seq(out, ref, cu), rel_err(out, ref)))
    return errors


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x in float32 with its mantissa rounded to TF32's 10 bits (to nearest, ties to even): what a
    GPU's tensor cores take of a float32 operand of tl.dot at its default input_precision."""
    bits = x.float().contiguous().view(torch.int32)
    rounded = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF
    return rounded.view(torch.float32)


def tf32_paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    """The Triton attention as a GPU runs it on a 16-bit model (dots at TF32, the rest float32), in
    float64: scores from TF32 q and k (exact for bf16 / fp16 inputs), the unnormalized
    probabilities and v rounded to TF32 before their product, the normalizer from the unrounded
    ones. The kernel rounds each probability against its running maximum, this reference against
    the final one: the roundings differ by at most half a TF32 unit (2^-11) of each term."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    for i, n in enumerate(seq_lens.tolist()):
        start, end = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        blocks = block_tables[i, :-(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, 1)  # [n, heads, D]
        v = v_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, 1)
        s = torch.einsum("thd,nhd->htn", tf32(q[start:end]).double(), tf32(k).double()) * scale
        positions = torch.arange(n - (end - start), n)
        s = s.masked_fill(torch.arange(n)[None, None, :] > positions[None, :, None], float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True))
        rounded = tf32(e.float()).double()
        out[start:end] = (torch.einsum("htn,nhd->thd", rounded, tf32(v).double())
                          / e.sum(-1).transpose(0, 1)[..., None])
    return out
