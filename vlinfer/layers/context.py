"""Per-step attention metadata, set by the model runner for the duration of one forward and cleared after."""
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    cu_seqlens_q: torch.Tensor  # [B+1] where each sequence's new tokens start in the packed batch
    seq_lens: torch.Tensor  # [B] KV length of each sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] padded with -1
    decode_only: bool = False


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _context is not None, "attention called outside a model runner step"
    return _context


@contextmanager
def forward_context(ctx: ForwardContext):
    global _context
    _context = ctx
    try:
        yield ctx
    finally:
        _context = None
