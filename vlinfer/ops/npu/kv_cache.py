"""int8 KV caches on torch_npu (kv_cache_dtype="int8", a static int8 / C8 checkpoint;
docs/npu-ops.md §2.10, §7.7), ops/reference/kv_cache.py's contract: npu_dynamic_quant + the cache
scatter write them, FIA antiquant mode 5 reads decodes. NpuOps' int8 KV methods (kv_cache_kernels,
int8_kv_scales, store_quantized_kvcache, quantized_paged_attention) are thin wrappers over these
functions, which take the NpuOps instance.

- Rows are quantized per token and KV head by npu_dynamic_quant and scattered like half rows;
  decodes read them in
  FIA's antiquant mode 5 (per token and head, the scales in pages of the cache: [num_blocks,
  kv_heads, block_size] in
  memory, which int8_kv_scales allocates); prefill chunks read their blocks back in the compute
  dtype
  (kv_quant_reference), since FIA takes no antiquant over a paged cache for a query longer than one
  token.
- Checked against the reference on first use; other compressed dtypes (fp8; fp16 / bf16 under
  another compute
  dtype) FIA cannot read: the reference runs them, logged.
"""
import logging

import torch

from vlinfer.ops import reference
from vlinfer.ops.npu import graph as npu_graph
from vlinfer.ops.npu.host import HALF_DTYPES, HALF_ONLY, AttentionMeta, bsh_decode_args
from vlinfer.ops.reference import kv_cache as kv_quant_reference

logger = logging.getLogger("vlinfer")
# FIA's antiquant mode 5: per token and KV head, the scales kept in pages of the cache (§2.10).
PAGED_PER_TOKEN_HEAD = 5


def int8_kv(ops) -> bool:
    """Whether int8 KV caches run on torch_npu: checked once, on first use (the model runner asks at
    start-up), against the reference; a failure is logged and the reference writes and reads them.
    """
    if "int8_kv" not in ops.features:
        if ops._capture is not None:
            raise RuntimeError(
                "the int8 KV cache check reads results on the host: ask kv_cache_kernels before "
                "capturing a graph")
        ops.features["int8_kv"] = check_int8_kv(ops, torch.device(ops.device_type))
    return ops.features["int8_kv"]


def int8_kv_scales(shape: tuple, device) -> torch.Tensor:
    # Antiquant mode 5 reads a layer's row scales as (num_blocks, kv_heads, block_size) (§2.10):
    # that memory order, seen as the [..., num_blocks, block_size, kv_heads] every writer and reader
    # indexes.
    return torch.ones(*shape[:-2], shape[-1], shape[-2], dtype=torch.float32,
                      device=device).transpose(-1, -2)


def int8_fallback(ops, op: str, fn, *args):
    ops._warn_fallback(op, torch.int8,
                       "this torch_npu failed the int8 KV cache check at load (logged there)")
    ops._no_fallback_in_capture(op, torch.int8)
    return fn(*args)


def _kv_cache_fallback(ops, op: str, fn, q_dtype, cache_dtype, *args):
    """Compressed caches the torch_npu kernels cannot run: fp8 and half caches under another compute
    dtype (FIA reads int8 or q's dtype), and any cache under a float32 model (FIA takes fp16/bf16
    queries)."""
    if cache_dtype == torch.int8 and q_dtype in HALF_DTYPES:
        return int8_fallback(ops, op, fn, *args)
    why = HALF_ONLY if q_dtype not in HALF_DTYPES else \
        "FIA reads int8 KV pages (antiquant) or pages of the query's dtype only (npu-ops.md §2.10)"
    ops._warn_fallback(op, cache_dtype, why)
    ops._no_fallback_in_capture(op, cache_dtype, why)
    return fn(*args)


# ---- write ----

def store_quantized_kvcache(ops, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    if k_cache.dtype != torch.int8 or key.dtype not in HALF_DTYPES or not int8_kv(ops):
        return _kv_cache_fallback(ops, "store_quantized_kvcache",
                                  kv_quant_reference.store_quantized_kvcache, key.dtype,
                                  k_cache.dtype, key, value, k_cache, v_cache, k_scale, v_scale,
                                  slot_mapping)
    _store_int8(ops, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def _store_int8(ops, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """kv_quant_reference's int8 rows: npu_dynamic_quant quantizes each (token, KV head) row over
    head_dim, scale = max |x| / 127 (float32, one per row); the rows are scattered as half rows are,
    the scales written into their (block, offset) with torch indexing (no host sync, so it is
    captured in a graph)."""
    slots, keep = ops._slots(slot_mapping)
    if keep is not None:
        key, value = key[keep], value[keep]
    k_rows, k_row_scale = ops._torch_npu.npu_dynamic_quant(key)
    v_rows, v_row_scale = ops._torch_npu.npu_dynamic_quant(value)
    ops._write_rows(k_rows, v_rows, k_cache, v_cache, slots)
    block_size, index = k_cache.shape[1], slots.long()
    blocks, offsets = index // block_size, index % block_size
    # an all-zero row: the reference's floor (its rows are 0 either way)
    tiny = torch.finfo(torch.float32).tiny
    k_scale[blocks, offsets] = k_row_scale.clamp_min(tiny)
    v_scale[blocks, offsets] = v_row_scale.clamp_min(tiny)


# ---- read ----


def quantized_paged_attention(ops, q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, seq_lens,
                              block_tables, scale):
    if k_cache.dtype != torch.int8 or q.dtype not in HALF_DTYPES or not int8_kv(ops):
        return _kv_cache_fallback(ops, "quantized_paged_attention",
                                  reference.quantized_paged_attention, q.dtype, k_cache.dtype, q,
                                  k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, seq_lens,
                                  block_tables, scale)
    if ops._capture is not None:
        return npu_graph.captured_decode_attention(ops, q.contiguous(), k_cache, v_cache,
                                                   block_tables, scale, antiquant(k_scale, v_scale))
    meta = ops._attention_step.get(AttentionMeta, cu_seqlens_q, seq_lens, block_tables)
    return _int8_attention(ops, q.contiguous(), k_cache, v_cache, k_scale, v_scale, meta, scale)


def _int8_attention(ops, q, k_cache, v_cache, k_scale, v_scale, meta: AttentionMeta, scale):
    # int8 pages: 32-aligned blocks for IFA (§2.10)
    ops.check_block_size(k_cache.shape[1], meta.max_q_len > 1, 32)
    # prefill chunks: PFA over their blocks read back (NpuOps._split_paged_attention)
    if meta.max_q_len > 1:
        return ops._split_paged_attention(q, k_cache, v_cache, meta, scale, (k_scale, v_scale))
    args, kwargs = bsh_decode_args(q, k_cache, v_cache, meta.block_table, meta.kv_lens,
                                   antiquant(k_scale, v_scale))
    return ops._fia(*args, scale, **kwargs).view(q.shape)


def antiquant(k_scale: torch.Tensor, v_scale: torch.Tensor) -> dict:
    """FIA's keywords for an int8 cache's row scales (§2.10): mode 5, per token and KV head, the
    scales in pages of the cache, (num_blocks, kv_heads, block_size) float32: the memory order
    int8_kv_scales allocates, seen through the [num_blocks, block_size, kv_heads] index order every
    other reader uses."""
    pages = {
        "key_antiquant_scale": k_scale.transpose(-1, -2),
        "value_antiquant_scale": v_scale.transpose(-1, -2)
    }
    for name, t in pages.items():
        if not t.is_contiguous():
            raise ValueError(
                f"{name}: an int8 cache's row scales must be laid out as NpuOps.int8_kv_scales "
                "makes "
                f"them ([num_blocks, kv_heads, block_size] in memory), got strides {t.stride()}")
    return dict(pages, key_antiquant_mode=PAGED_PER_TOKEN_HEAD,
                value_antiquant_mode=PAGED_PER_TOKEN_HEAD)


# ---- the check on first use ----

def check_int8_kv(ops, device: torch.device) -> bool:
    """Quantize and write a tiny int8 cache, then read it in a mixed step (a chunk after a cached
    prefix that crosses a block edge, and a decode), against the reference: the ops and keywords
    this path needs (§2.10), surfaced at start-up rather than mid-request. Any failure: a warning,
    and False."""
    g = torch.Generator().manual_seed(0)
    bs, num_heads, num_kv_heads, head_dim = 128, 4, 2, 64
    kv_lens, tables = [130, 5], torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(kv_lens)]).to(device)
    keys, values, q = (torch.randn(n, h, head_dim, generator=g).to(device, torch.float16)
                       for n, h in ((len(slots), num_kv_heads), (len(slots), num_kv_heads),
                                    (4, num_heads)))
    caches = [
        torch.zeros(3, bs, num_kv_heads, head_dim, dtype=torch.int8, device=device)
        for _ in range(4)
    ]
    scales = [int8_kv_scales((3, bs, num_kv_heads), device) for _ in range(4)]
    cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
    seq_lens, tables = torch.tensor(kv_lens, dtype=torch.int32, device=device), tables.to(device)
    try:
        _store_int8(ops, keys, values, caches[0], caches[1], scales[0], scales[1], slots)
        kv_quant_reference.store_quantized_kvcache(keys, values, caches[2], caches[3], scales[2],
                                                   scales[3], slots)
        # Rows within one step of the reference's (a rounding tie may fall the other way), scales
        # equal.
        rows_off = max(
            (a.int() - b.int()).abs().max().item() for a, b in zip(caches[:2], caches[2:]))
        if rows_off > 1 or not all(
                torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(scales[:2], scales[2:])):
            raise RuntimeError(
                f"the int8 rows or their scales differ from the reference's (rows by {rows_off})")
        out = _int8_attention(ops, q, *caches[:2], *scales[:2], AttentionMeta(cu, seq_lens, tables),
                              0.125)
        ref = reference.quantized_paged_attention(q.float(), *caches[:2], *scales[:2], cu, seq_lens,
                                                  tables, 0.125)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        if not err < 1e-2:
            raise RuntimeError(f"FIA over the int8 cache is off from the reference by {err:.3g}")
    except Exception as e:
        logger.warning(
            "ops[npu]: int8 KV cache check failed (%s: %s): int8 caches are written and read by "
            "the "
            "pure-torch reference",
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "")
        return False
    finally:
        ops._slots_step.reset()
    logger.info(
        "ops[npu]: int8 KV cache: npu_dynamic_quant + %s write it, FIA antiquant mode %d reads "
        "decodes",
        ops.features["cache_write"], PAGED_PER_TOKEN_HEAD)
    return True
