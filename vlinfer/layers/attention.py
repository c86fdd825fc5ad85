"""Attention over the paged KV cache: writes this step's keys and values into their slots, then attends."""
import torch
from torch import nn

from vlinfer.layers.context import ModelContext


class Attention(nn.Module):
    def __init__(self, ctx: ModelContext, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.ctx = ctx  # the step's metadata is read from it at each forward
        self.ops = ctx.ops
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # Views into the engine's KV pool [num_blocks, block_size, kv_heads, head_dim], bound by the model runner.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        step = self.ctx.forward_context()
        self.ops.store_kvcache(k, v, self.k_cache, self.v_cache, step.slot_mapping)
        o = self.ops.paged_attention(q, self.k_cache, self.v_cache, step.cu_seqlens_q, step.seq_lens,
                                     step.block_tables, self.scale)
        return o.flatten(1)
