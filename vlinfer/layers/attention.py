"""Attention over the paged KV cache: writes this step's keys and values into their slots, then
attends."""
import torch
from torch import nn

from vlinfer.layers.context import ModelContext
from vlinfer.ops.reference import kv_cache as kv_quant_reference


class Attention(nn.Module):
    def __init__(self, ctx: ModelContext, num_heads: int, head_dim: int, scale: float,
                 num_kv_heads: int):
        super().__init__()
        self.ctx = ctx  # the step's metadata is read from it at each forward
        self.ops = ctx.ops
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # Views into the engine's KV pool [num_blocks, block_size, kv_heads, head_dim], bound by the
        # model runner.
        self.k_cache = self.v_cache = torch.tensor([])
        # With a cache stored in another dtype (kv_cache_dtype): its scales
        # (ops/reference/kv_cache.py), bound with the cache. None: the cache holds the compute
        # dtype.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # A checkpoint's static KV scales (layers/quantization/kv_cache.py StaticKVScales), when its
        # cache dtype runs.
        self.static_kv_scales = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        step = self.ctx.forward_context()
        if self.k_scale is not None and self.static_kv_scales is not None \
                and self.k_cache.dtype == torch.int8:
            return self._static_int8(q, k, v, step)
        if self.k_scale is not None:
            self.ops.store_quantized_kvcache(k, v, self.k_cache, self.v_cache, self.k_scale,
                                             self.v_scale, step.slot_mapping)
            o = self.ops.quantized_paged_attention(q, self.k_cache, self.v_cache, self.k_scale,
                                                   self.v_scale, step.cu_seqlens_q, step.seq_lens,
                                                   step.block_tables, self.scale)
            return o.flatten(1)
        self.ops.store_kvcache(k, v, self.k_cache, self.v_cache, step.slot_mapping)
        o = self.ops.paged_attention(q, self.k_cache, self.v_cache, step.cu_seqlens_q,
                                     step.seq_lens, step.block_tables, self.scale)
        return o.flatten(1)

    def _static_int8(self, q, k, v, step) -> torch.Tensor:
        """A static int8 cache, read by the per-row int8 path with row scales 1.0: K's channel
        scales multiply the query, V's scale and offset apply to the output
        (ops/reference/kv_cache.py says why that is exact)."""
        s, group = self.static_kv_scales, self.num_heads // self.num_kv_heads
        # The rows are int8 already: the op table's plain cache write copies them (row scales stay
        # 1.0).
        self.ops.store_kvcache(kv_quant_reference.quantize_static(k, s.k_scale, s.k_offset),
                               kv_quant_reference.quantize_static(v, s.v_scale, s.v_offset),
                               self.k_cache, self.v_cache, step.slot_mapping)
        q = q * s.k_scale.repeat_interleave(group, 0).to(q.dtype)
        o = self.ops.quantized_paged_attention(q, self.k_cache, self.v_cache, self.k_scale,
                                               self.v_scale, step.cu_seqlens_q, step.seq_lens,
                                               step.block_tables, self.scale)
        v_scale = s.v_scale.repeat_interleave(group, 0)
        o = o.float() * v_scale
        if s.v_offset is not None:
            o -= v_scale * s.v_offset.repeat_interleave(group, 0)
        return o.to(q.dtype).flatten(1)
