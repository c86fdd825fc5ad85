"""KV cache write for CUDA in Triton: one program per new token copies its keys and values, all KV
heads, into its slot of the paged cache [num_blocks, block_size, kv_heads, head_dim]. A slot < 0
(padding, such as the unused rows of a CUDA graph's batch) writes nothing. The skip is a mask inside
the kernel, not a host-side filter, so the write takes no device->host sync and a CUDA graph can
capture it.

Loaded by file path by vlinfer/ops/cuda/loader.py: triton/ is not a package, because
`kernels` is the name of an unrelated PyPI package that transformers probes for. Runs on CPU tensors
under the Triton interpreter (TRITON_INTERPRET=1 set before this file is loaded), which is how
tests/ops/cuda/test_cuda_ops.py checks it without a GPU.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    # int64: slot * row size passes 2**31 for caches over 2 GiB of elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM) & (slot >= 0)
    # key/value are usually strided views of the fused qkv projection: rows and heads by stride,
    # head_dim contiguous.
    k = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + heads * value_stride_h + dims, mask=mask)
    dst = slot * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims  # the cache is contiguous
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """reference.store_kvcache's contract: key/value [T, kv_heads, head_dim] into the caches at flat
    slots, slots < 0 skipped. Slots are trusted (they come from the block manager): checking the
    range would need a host sync."""
    num_tokens, num_heads, head_dim = key.shape
    if k_cache.shape[2:] != key.shape[
            1:] or v_cache.shape != k_cache.shape or value.shape != key.shape:
        raise ValueError(
            f"store_kvcache: key {tuple(key.shape)}, value {tuple(value.shape)}, caches "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kvcache: the caches must be contiguous")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"store_kvcache: {num_tokens} tokens but slot_mapping is {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    # The kernel stores what it loads; cast first so a float32 activation lands in a bf16 cache as
    # the reference does.
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim))


# ---- the write into a cache of another dtype (kv_cache_dtype; ops/reference/kv_cache.py defines
# the rows) ---- No jit helpers of triton.language (tl.max, tl.zeros): the interpreter cannot run
# those when triton was imported before TRITON_INTERPRET was set (cuda/triton/paged_attention.py
# says the same), so reductions go through tl.reduce with triton's own combine.
@triton.jit
def _float_bits(y, MANTISSA: tl.constexpr, BIAS: tl.constexpr, SIGN: tl.constexpr):
    """float32 y (within the format's range) -> the bits of a smaller float (e4m3fn: MANTISSA 3,
    BIAS 7, SIGN 0x80; e5m2: 2, 15, 0x80; float16: 10, 15, 0x8000) as int32, rounded to nearest even
    as torch's casts round. Encoded from the bits rather than with a cast: the Triton interpreter's
    narrowing casts truncate, and its float8 cast drops the carry of a mantissa that rounds up into
    the next power of two."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    shift: tl.constexpr = 23 - MANTISSA
    kept = (bits & 0x7FFFFF) >> shift
    rest = bits & ((1 << shift) - 1)
    half: tl.constexpr = 1 << (shift - 1)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    # A carry out of the mantissa moves into the exponent field by itself.
    normal = ((exponent + BIAS) << MANTISSA) + kept + up.to(tl.int32)
    # Below the smallest normal: a multiple of the subnormal step, rounded half to even (exact: a
    # power-of-two scale).
    steps = a * (2.0 ** (BIAS - 1 + MANTISSA))
    low = tl.floor(steps)
    frac = steps - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0
    subnormal = tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low).to(tl.int32)
    code = tl.where(exponent + BIAS <= 0, subnormal, normal)
    return code | tl.where(y < 0, SIGN, 0)


@triton.jit
def _bfloat16_bits(y):
    """float32 -> bfloat16 bits as int32, rounded to nearest even (finite values)."""
    bits = y.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _store_kvcache_quantized_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                    v_scale_ptr, slot_ptr, key_stride_t, key_stride_h,
                                    value_stride_t, value_stride_h, NUM_HEADS: tl.constexpr,
                                    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                                    BLOCK_D: tl.constexpr, INT8: tl.constexpr, FORMAT: tl.constexpr,
                                    LIMIT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)[None, :]
    head_mask = (heads < NUM_HEADS) & (slot >= 0)
    mask = head_mask[:, None] & (dims < HEAD_DIM)
    dst = slot * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims
    scale_index = slot * NUM_HEADS + heads
    # K then V in one body.
    for side in tl.static_range(2):
        if side == 0:
            x = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims,
                        mask=mask, other=0.0)
            cache_ptr, scale_ptr = k_cache_ptr, k_scale_ptr
        else:
            x = tl.load(value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims,
                        mask=mask, other=0.0)
            cache_ptr, scale_ptr = v_cache_ptr, v_scale_ptr
        x = x.to(tl.float32)
        if INT8:  # a scale per row (token and KV head), written beside it
            row_max = tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max)
            row_scale = tl.maximum(row_max / 127.0, 1.1754943508222875e-38)
            # torch.round's rule, ties to even; exact for |y| < 2**23, where floor and the fraction
            # left are exact.
            y = x / row_scale[:, None]
            low = tl.floor(y)
            frac = y - low
            odd = (low - 2.0 * tl.floor(low * 0.5)) != 0
            q = tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low)
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(cache_ptr + dst, q.to(tl.int8), mask=mask)
            tl.store(scale_ptr + scale_index, row_scale, mask=head_mask)
        else:  # one scale per layer, saturated to the format's range
            y = tl.minimum(tl.maximum(x / tl.load(scale_ptr), -LIMIT), LIMIT)
            if FORMAT == 1:
                tl.store(cache_ptr + dst, _float_bits(y, 3, 7, 0x80).to(tl.uint8), mask=mask)
            elif FORMAT == 2:
                tl.store(cache_ptr + dst, _float_bits(y, 2, 15, 0x80).to(tl.uint8), mask=mask)
            elif FORMAT == 3:
                tl.store(cache_ptr + dst, _float_bits(y, 10, 15, 0x8000).to(tl.int16), mask=mask)
            else:
                tl.store(cache_ptr + dst, _bfloat16_bits(y).to(tl.int16), mask=mask)


def store_kvcache_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
    """kv_quant_reference.store_quantized_kvcache's contract: each row quantized into the cache's
    dtype (int8: its scale written at the same slot of k_scale / v_scale), slots < 0 skipped, no
    host sync."""
    num_tokens, num_heads, head_dim = key.shape
    if k_cache.shape[2:] != key.shape[
            1:] or v_cache.shape != k_cache.shape or value.shape != key.shape:
        raise ValueError(
            f"store_kvcache_quantized: key {tuple(key.shape)}, value {tuple(value.shape)}, caches "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match")
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    int8 = k_cache.dtype == torch.int8
    # Floating caches are written as their bits (see _float_bits): 1 e4m3fn, 2 e5m2, 3 float16, 4
    # bfloat16.
    fmt = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.float16: 3,
           torch.bfloat16: 4}.get(k_cache.dtype, 0)
    if not int8 and not fmt:
        raise ValueError(
            f"store_kvcache_quantized: no quantized write into a {k_cache.dtype} cache")
    limit = 127.0 if int8 else float(torch.finfo(k_cache.dtype).max)
    if fmt:
        bits = torch.uint8 if fmt <= 2 else torch.int16
        k_cache, v_cache = k_cache.view(bits), v_cache.view(bits)
    _store_kvcache_quantized_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), INT8=int8, FORMAT=fmt, LIMIT=limit)
