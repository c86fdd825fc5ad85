"""A pure-torch stand-in for the two flash_attn functions vlinfer's CUDA path calls, so that path
runs on CPU tensors.

Written from flash_attn's documented contracts (the docstrings of flash_attn_varlen_func and
flash_attn_with_kvcache, flash-attn 2.x), not from vlinfer/ops/reference/: q/k/v last dim
contiguous, fp16/bf16 only, int32 cu_seqlens, cache_seqlens and block_table, a paged cache's
page_block_size a multiple of 256, heads a multiple of KV heads, the causal mask aligned to the
bottom-right corner, a row with nothing to attend to giving zeros. A violation raises
FakeFlashError, so a call the real library would reject fails the test. Computes in float32, casts
at the end.

Use `install(monkeypatch)`: sys.modules["flash_attn"] and VLINFER_OPS=cuda, undone when the test
ends. A CudaOps made while it is installed (directly, or by an engine starting) loads the fake; an
earlier one keeps what it loaded.
"""
import sys
import types

import torch

HALF = (torch.float16, torch.bfloat16)
PAGE_MULTIPLE = 256


class FakeFlashError(RuntimeError):
    pass


def _require(cond, message):
    if not cond:
        raise FakeFlashError(message)


def _check_qkv(q, k, v):
    _require(q.dtype in HALF and k.dtype == q.dtype and v.dtype == q.dtype,
             f"fp16/bf16 only, got {q.dtype}")
    _require(
        q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1,
        "last dim must be contiguous")
    _require(q.shape[-2] % k.shape[-2] == 0, "heads must be a multiple of KV heads")
    _require(q.shape[-1] == k.shape[-1] and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256,
             "bad head_dim")


def _int32(t, name):
    _require(
        isinstance(t, torch.Tensor) and t.dtype == torch.int32, f"{name} must be an int32 tensor")
    return t.tolist()


def _attend(q, k, v, scale, causal):
    """q [Sq, H, D], k/v [Sk, Hk, D] -> [Sq, H, D] float32; causal aligned bottom-right; empty rows
    give 0."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    sq, sk = q.shape[0], k.shape[0]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)  # all-masked rows: zeros
    return torch.einsum("hqk,khd->qhd", p, v)


def _paged(cache, table_row, length, name):
    num_blocks, page = cache.shape[0], cache.shape[1]
    _require(page % PAGE_MULTIPLE == 0,
             f"{name}: page_block_size must be a multiple of {PAGE_MULTIPLE}, got {page}")
    needed = -(-length // page)
    _require(needed <= len(table_row), f"{name}: block_table row too short for length {length}")
    ids = table_row[:needed]
    _require(all(0 <= b < num_blocks for b in ids), f"{name}: block ids {ids} outside the cache")
    return cache[ids].flatten(0, 1)[:length]


class FakeFlashAttn(types.ModuleType):
    __version__ = "2.8.3-fake"

    def __init__(self):
        super().__init__("flash_attn")
        self.history = []  # (function name, kwargs of interest)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        _check_qkv(q, k, v)
        _require(
            isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int),
            "max_seqlen_* must be host ints")
        cu_q, cu_k = _int32(cu_seqlens_q, "cu_seqlens_q"), _int32(cu_seqlens_k, "cu_seqlens_k")
        _require(
            len(cu_q) == len(cu_k) and cu_q[0] == 0 and cu_k[0] == 0 and cu_q[-1] == q.shape[0],
            "cu_seqlens do not describe q")
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
        k_lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
        _require(
            max(q_lens) <= max_seqlen_q and max(k_lens) <= max_seqlen_k,
            "max_seqlen below a length")
        table = None
        if block_table is not None:
            table = _int32(block_table, "block_table")
            _require(k.dim() == 4 and len(table) == len(q_lens),
                     "paged: k [num_blocks, page, Hk, D], B table rows")
        else:
            _require(k.shape[0] == cu_k[-1], "cu_seqlens_k do not describe k")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out = torch.empty(q.shape, dtype=torch.float32)
        for i, (nq, nk) in enumerate(zip(q_lens, k_lens)):
            if table is not None:
                ks, vs = _paged(k, table[i], nk, "k"), _paged(v, table[i], nk, "v")
            else:
                ks, vs = k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
            out[cu_q[i]:cu_q[i + 1]] = _attend(q[cu_q[i]:cu_q[i + 1]], ks, vs, scale, causal)
        self.history.append(
            ("flash_attn_varlen_func",
             dict(causal=causal, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                  cu_seqlens_k=cu_k, paged=table is not None, softmax_scale=scale)))
        return out.to(q.dtype)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), rotary_interleaved=True,
                                alibi_slopes=None, num_splits=0, softcap=0.0):
        _check_qkv(q, k_cache, v_cache)
        _require(q.dim() == 4, "q must be [batch, seqlen, heads, head_dim]")
        _require(k is None and v is None, "vlinfer writes the cache itself")
        batch = q.shape[0]
        lens = _int32(cache_seqlens, "cache_seqlens")
        _require(len(lens) == batch, "one cache_seqlens entry per batch row")
        _require(block_table is not None, "vlinfer's cache is paged")
        table = _int32(block_table, "block_table")
        _require(len(table) == batch, "one block_table row per batch row")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out = torch.empty(q.shape, dtype=torch.float32)
        for i in range(batch):
            ks, vs = _paged(k_cache, table[i], lens[i],
                            "k_cache"), _paged(v_cache, table[i], lens[i], "v_cache")
            out[i] = _attend(q[i], ks, vs, scale, causal)
        self.history.append(("flash_attn_with_kvcache",
                             dict(causal=causal, q_shape=tuple(q.shape), cache_seqlens=lens,
                                  softmax_scale=scale)))
        return out.to(q.dtype)


def install(monkeypatch) -> FakeFlashAttn:
    """Put a fake flash_attn into sys.modules and force VLINFER_OPS=cuda; monkeypatch undoes both
    when the test ends. Op state lives in the CudaOps instances, so there is nothing else to
    restore."""
    fake = FakeFlashAttn()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setenv("VLINFER_OPS", "cuda")
    return fake
