"""KV cache write for CUDA in Triton: one program per new token copies its keys and values, all KV heads, into its
slot of the paged cache [num_blocks, block_size, kv_heads, head_dim]. A slot < 0 (padding, such as the unused rows
of a CUDA graph's batch) writes nothing. The skip is a mask inside the kernel, not a host-side filter, so the write
takes no device->host sync and a CUDA graph can capture it.

Loaded by file path from vlinfer/ops/cuda.py: kernels/ is not a Python package, because `kernels` is the name of an
unrelated PyPI package that transformers probes for. Runs on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1 set before this file is loaded), which is how tests/test_cuda_ops.py checks it without a GPU.
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
    # key/value are usually strided views of the fused qkv projection: rows and heads by stride, head_dim contiguous.
    k = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + heads * value_stride_h + dims, mask=mask)
    dst = slot * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims  # the cache is contiguous
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """reference.store_kvcache's contract: key/value [T, kv_heads, head_dim] into the caches at flat slots, slots < 0
    skipped. Slots are trusted (they come from the block manager): checking the range would need a host sync."""
    num_tokens, num_heads, head_dim = key.shape
    if k_cache.shape[2:] != key.shape[1:] or v_cache.shape != k_cache.shape or value.shape != key.shape:
        raise ValueError(f"store_kvcache: key {tuple(key.shape)}, value {tuple(value.shape)}, caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kvcache: the caches must be contiguous")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"store_kvcache: {num_tokens} tokens but slot_mapping is {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    # The kernel stores what it loads; cast first so a float32 activation lands in a bf16 cache as the reference does.
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
