"""Attention on CUDA beside flash_attn's calls (backend.py): our Triton attention
(triton/paged_attention.py) and the cache write (triton/store_kvcache.py), each checked against the
reference when loaded; the sync-free matmul decode that runs where Triton cannot; and the per-step
host metadata flash_attn's varlen call needs."""
import torch

from vlinfer.ops import reference
from vlinfer.ops.cuda.loader import load_triton_module

HALF_DTYPES = (torch.float16, torch.bfloat16)
FLASH_BLOCK_MULTIPLE = 256  # flash_attn's paged KV: page_block_size % 256 == 0


def checked_cache_write(device: torch.device):
    """The Triton store_kvcache, after one small write (two KV heads, a padding slot) compared with
    the reference: surfaces a Triton that cannot compile here now, not mid-request."""
    store = load_triton_module("store_kvcache").store_kvcache
    g = torch.Generator().manual_seed(0)
    key = torch.randn(5, 2, 64, generator=g).to(device)
    value = torch.randn(5, 2, 64, generator=g).to(device)
    slots = torch.tensor([3, -1, 17, 0, 30], device=device)
    ours = [torch.zeros(2, 16, 2, 64, device=device) for _ in range(2)]
    ref = [torch.zeros(2, 16, 2, 64, device=device) for _ in range(2)]
    store(key, value, ours[0], ours[1], slots)
    reference.store_kvcache(key, value, ref[0], ref[1], slots)
    if not (torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])):
        raise RuntimeError("the Triton cache write did not match the reference")
    return store


def checked_attention(device: torch.device):
    """Our Triton attention module (triton/paged_attention.py), after one mixed step (a prefill
    chunk after a cached prefix, a decode, a graph's empty row) with GQA, its keys split in two (the
    split-KV path and its combine), compared with the reference. One launch pair: engines are built
    often in the tests, under the interpreter."""
    module = load_triton_module("paged_attention")
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(4, 16, 2, 32, generator=g).to(device) for _ in range(2))
    q = torch.randn(5, 4, 32, generator=g).to(device)
    cu = torch.tensor([0, 3, 4, 5, 5], dtype=torch.int32, device=device)
    lens = torch.tensor([20, 2, 30, 0], dtype=torch.int32, device=device)
    tables = torch.tensor([[1, 0], [2, -1], [3, 1], [-1, -1]], dtype=torch.int32, device=device)
    ours = module.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.125, splits=2)
    expected = reference.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.125)
    err = ((ours.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    if not err < 1e-3:
        raise RuntimeError(f"the Triton attention is off from the reference by {err:.3g}")
    return module


def paged_meta(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor):
    """flash_attn_varlen_func's cu_seqlens_k (int32, on the device) and host max_seqlen_q /
    max_seqlen_k: one sync per step, not per layer (CudaOps keeps it in a PerStep)."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    cu_k = torch.nn.functional.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    max_q, max_k = torch.stack([q_lens.max(), seq_lens.max()]).tolist()
    return cu_k, int(max_q), int(max_k)


def max_segment(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale):
    """q [B, heads, D], one query per sequence, over the block table's whole width [B, W] masked by
    seq_lens: fixed shapes and no host sync, so a CUDA graph can capture it. Softmax in float32, as
    the reference.

    Costs a gather of B * W * block_size keys and values; the graph runner bounds W
    (engine/graph_runner.py MAX_CAPTURE_LEN). Masked scores take float32's lowest value rather than
    -inf, so a row with no keys (seq_len 0: a padded row of a graph's batch) gives zeros instead of
    NaN; for any other row those weights are exactly zero either way."""
    b, width = block_tables.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    length = width * k_cache.shape[1]
    # -1 padding reads block 0, masked below
    flat = block_tables.clamp_min(0).flatten().to(torch.long)
    k = k_cache.index_select(0, flat).view(b, length, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(b, length, num_kv_heads, head_dim).transpose(1, 2)
    beyond = torch.arange(length, device=q.device)[None, :] >= seq_lens[:, None]
    # Slots past a sequence's length may hold uninitialized memory (NaN), and 0 * NaN is NaN: zero
    # them.
    v = v.masked_fill(beyond[:, None, :, None], 0)
    qd = q.reshape(b, num_kv_heads, group, head_dim)
    scores = torch.matmul(qd, k.transpose(-1, -2)).float().mul_(scale)
    scores.masked_fill_(beyond[:, None, None, :], torch.finfo(torch.float32).min)
    o = torch.matmul(scores.softmax(-1).to(v.dtype), v)
    return o.reshape(b, num_kv_heads * group, head_dim)
