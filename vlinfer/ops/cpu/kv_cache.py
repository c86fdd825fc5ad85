"""KV caches stored in another dtype on the CPU (csrc/kv_quant.cpp), ops/reference/kv_cache.py's
contract: the write and decode attention read the stored rows in our kernels. Prefill chunks over
an int8 cache with bf16 queries run the bf16 flash kernel on rows it reads back itself
(csrc/attention_bf16.cpp prefill_attention_int8), where the bf16 cache's chunks run it too; other
chunks read their blocks back in the compute dtype (the reference's dequantized_blocks) for
SDPA."""
import torch

from vlinfer.ops import reference
from vlinfer.ops.cpu import attention
from vlinfer.ops.reference import kv_cache

# Cache dtypes the kernels write and read under another compute dtype.
KV_CACHE_KERNELS = (torch.int8, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                    torch.float8_e5m2)


def quantized_paged_attention(ext, decode_rows, q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q,
                              seq_lens, block_tables, scale, bf16_flash: bool):
    """decode_rows: attention.decode_rows of this step (the op table keeps it per step);
    bf16_flash: whether the bf16 prefill kernel takes these queries (CpuOps._bf16_flash)."""
    seq_lens, block_tables = seq_lens.to(torch.int32), block_tables.to(torch.int32)
    if decode_rows is None:
        return ext.paged_decode_attention_quantized(q, k_cache, v_cache, k_scale, v_scale,
                                                    block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    prefill_tables = block_tables
    if decode_rows.numel():
        token_index = cu_seqlens_q[decode_rows]
        out[token_index] = ext.paged_decode_attention_quantized(
            q[token_index], k_cache, v_cache, k_scale, v_scale, block_tables[decode_rows],
            seq_lens[decode_rows], scale)
        # their blocks need no reading back
        prefill_tables = block_tables.index_fill(0, decode_rows, -1)
    if bf16_flash and k_cache.dtype == torch.int8:
        ext.prefill_attention_int8(q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, seq_lens,
                                   block_tables, scale, out)
        return out
    k, v, tables = kv_cache.dequantized_blocks(k_cache, v_cache, k_scale, v_scale, prefill_tables,
                                               q.dtype)
    reference.prefill_attention(q, k, v, cu_seqlens_q, seq_lens, tables, scale, out,
                                attention.chunk_over_context)
    return out
