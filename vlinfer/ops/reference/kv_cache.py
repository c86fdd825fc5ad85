"""The KV cache write (store_kvcache), and what a cache stored in another dtype than the compute
dtype means: how a row is written and how it reads back.

Two kinds of scale, one per cache dtype family:
- int8: one float32 scale per token and KV head (k_scale / v_scale indexed [num_blocks, block_size,
  kv_heads]; their
  memory order is the op table's, ReferenceOps.int8_kv_scales), written beside the row when it is
  stored: scale =
  max |x| / 127 over the row's head_dim values, the row rounded to nearest. Accurate without
  calibration.
- floating caches (fp8 e4m3 / e5m2, bfloat16, float16): one float32 scale per layer for K and one
  for V (0-d
  tensors): stored = x / scale, saturated to the format's range; read = stored * scale. 1.0 unless
  the checkpoint
  has scales.
- static int8 (a checkpoint's calibrated scales, layers/quantization/kv_cache.py): stored = round(x
  / scale +
  offset) clamped to [-128, 127], scale and offset per KV channel ([kv_heads, head_dim]). Such rows
  are read by the
  per-row int8 path with every row scale 1.0: K's channel scale moves onto the query and V's onto
  the output
  (layers/attention.py). That is exact algebra: score = sum_c q_c * s_c * (k_c - o_c) = sum_c (q_c *
  s_c) * k_c minus
  a constant per query, which softmax drops; out_c = sum_t p_t * s_c * (v_tc - o_c) = s_c * sum_t
  p_t * v_tc -
  s_c * o_c, since the weights p sum to 1.
Reads accumulate in float32 and hand the attention the compute dtype. Device kernels must match
these."""
import torch

INT8_MAX = 127.0


def quantize_rows(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor):
    """x [T, kv_heads, head_dim] -> (rows in cache_dtype, the per-row scales [T, kv_heads] for int8,
    else None)."""
    x = x.float()
    if cache_dtype == torch.int8:
        row_scale = (x.abs().amax(-1) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return (x / row_scale[..., None]).round_().clamp_(-INT8_MAX,
                                                          INT8_MAX).to(torch.int8), row_scale
    limit = torch.finfo(cache_dtype).max
    return (x / scale).clamp_(-limit, limit).to(cache_dtype), None


def quantize_static(x: torch.Tensor, scale: torch.Tensor,
                    offset: torch.Tensor | None) -> torch.Tensor:
    """x [T, kv_heads, head_dim] -> int8 rows with static per-channel scale and offset [kv_heads,
    head_dim]."""
    q = x.float() / scale
    if offset is not None:
        q = q + offset
    return q.round_().clamp_(-128, 127).to(torch.int8)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks or rows of a cache [..., kv_heads, head_dim] and their scales ([..., kv_heads] for
    int8, 0-d for a floating cache) -> values in dtype."""
    values = stored.float()
    values = values * (scale[..., None] if scale.dim() else scale)
    return values.to(dtype)


def store_quantized_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
    """store_kvcache for a cache in another dtype: each row quantized (int8: its scale written at
    the same slot of k_scale / v_scale). Slots < 0 are padding and are skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows, row_scale = quantize_rows(x, cache.dtype, scale)
        flat = cache.view(-1, *cache.shape[2:])
        # index_copy_ has no fp8 kernel on CPU
        if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            flat.view(torch.uint8).index_copy_(0, slot_mapping, rows.view(torch.uint8))
        else:
            flat.index_copy_(0, slot_mapping, rows)
        if row_scale is not None:  # indexed, not viewed flat: an op table may keep them heads-major
            block_size = scale.shape[1]
            scale[slot_mapping // block_size, slot_mapping % block_size] = row_scale


def dequantized_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                       v_scale: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype):
    """The blocks block_tables names, read back in dtype, and the tables renumbered to them: (k, v,
    tables) that paged_attention runs on as on a cache of the compute dtype."""
    used = torch.unique(block_tables[block_tables >= 0]).long()
    if used.numel() == 0:
        used = torch.zeros(1, dtype=torch.long, device=block_tables.device)

    def blocks(cache, cache_scale):
        return dequantize(_select_blocks(cache, used),
                          cache_scale[used] if cache_scale.dim() else cache_scale, dtype)

    local = torch.searchsorted(used, block_tables.long().clamp_min(0)).to(block_tables.dtype)
    return blocks(k_cache, k_scale), blocks(v_cache,
                                            v_scale), torch.where(block_tables >= 0, local,
                                                                  block_tables)


def _select_blocks(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # index_select has no fp8 kernel on CPU
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache.view(torch.uint8).index_select(0, index).view(cache.dtype)
    return cache.index_select(0, index)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, kv_heads, head_dim] into the paged cache [num_blocks, block_size,
    kv_heads, head_dim] at flat slot indices; slots < 0 are padding and are skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
