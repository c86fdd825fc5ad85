"""KV caches stored in another dtype on CUDA (kv_cache_dtype: int8, fp8, half under another compute
dtype), the reference's contract (ops/reference/kv_cache.py): our Triton quantizing cache write
(triton/store_kvcache.py) and paged attention over the stored rows (triton/paged_attention.py),
checked on first use."""
import torch

from vlinfer.ops import reference
from vlinfer.ops.cuda.loader import load_triton_module
from vlinfer.ops.reference import kv_cache

# Cache dtypes our Triton kernels write and read under another compute dtype (kv_cache_dtype).
COMPRESSED_KV_DTYPES = (torch.int8, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                        torch.float8_e5m2)


def checked_quantized_cache(device: torch.device):
    """The Triton quantizing cache write and paged attention, after a mixed step (a prefill chunk
    after a cached prefix, and a decode) into an int8 cache and a float16 one, compared with the
    reference."""
    store = load_triton_module("store_kvcache").store_kvcache_quantized
    attention = load_triton_module("paged_attention").paged_attention
    g = torch.Generator().manual_seed(0)
    key, value = (torch.randn(20, 2, 64, generator=g).to(device) for _ in range(2))
    # sequence 0: blocks 1, 0
    slots = torch.cat([torch.arange(16, 32), torch.arange(0, 4)]).to(device)
    q = torch.randn(4, 4, 64, generator=g).to(device)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
    lens = torch.tensor([20, 2], dtype=torch.int32, device=device)
    tables = torch.tensor([[1, 0], [2, -1]], dtype=torch.int32, device=device)
    for dtype, scale_shape in ((torch.int8, (3, 16, 2)), (torch.float16, ())):
        caches = [torch.zeros(3, 16, 2, 64, dtype=dtype, device=device) for _ in range(4)]
        scales = [torch.ones(scale_shape, device=device) for _ in range(4)]
        store(key, value, caches[0], caches[1], scales[0], scales[1], slots)
        kv_cache.store_quantized_kvcache(key, value, caches[2], caches[3], scales[2], scales[3],
                                         slots)
        if not all(
                torch.equal(a, b)
                for a, b in zip(caches[:2] + scales[:2], caches[2:] + scales[2:])):
            raise RuntimeError(f"the Triton {dtype} cache write did not match the reference")
        ours = attention(q, caches[0], caches[1], cu, lens, tables, 0.125, scales[0], scales[1])
        expected = reference.quantized_paged_attention(q, caches[0], caches[1], scales[0],
                                                       scales[1], cu, lens, tables, 0.125)
        err = ((ours.float() - expected).abs().max() / expected.abs().max()).item()
        if not err < 1e-3:
            raise RuntimeError(
                f"the Triton paged attention over a {dtype} cache is off from the reference by "
                f"{err:.3g}"
            )
    return store, attention
