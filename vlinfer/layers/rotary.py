"""Rotary position embedding with inverse frequencies computed the way transformers computes them
for the checkpoint's rope type (default, llama3, linear, dynamic ntk, yarn, ...), and Qwen3-VL's
interleaved multimodal rotary (MRoPE) cos/sin for 3-row (t, h, w) positions."""
from functools import lru_cache

import torch
from torch import nn


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) for a transformers text config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary cos/sin for token positions [T], read from a table built once."""

    def __init__(self, config, max_position: int):
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config)
        t = torch.arange(max_position, dtype=torch.float)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_dim] each, float32: ops.apply_rotary rotates in float32 whatever the activation
        dtype."""
        return self.cos_cache[positions], self.sin_cache[positions]


@lru_cache(maxsize=16)
def _interleave_rows(mrope_section: tuple[int, ...], half: int,
                     device: torch.device) -> torch.Tensor:
    """Which position row (0=t, 1=h, 2=w) drives each of the head_dim/2 frequencies.

    Interleaved MRoPE: frequency j uses row j % 3 while that row still has budget (h: first
    3*section[1] slots, w: first 3*section[2]); everything else, including the tail, stays temporal.
    """
    rows = torch.zeros(half, dtype=torch.long)
    for dim in (1, 2):
        rows[dim:mrope_section[dim] * 3:3] = dim
    # Cached on the device: a host->device copy per forward would be a sync, and is not allowed
    # while a CUDA graph captures the decode step.
    return rows.to(device)


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section,
                  attention_scaling: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for positions [3, T], usable by the standard neox rotary
    (rotate_half).

    Same values as HF `Qwen3VLTextRotaryEmbedding`: each frequency's angle is pos_row * inv_freq in
    float32 for the row the interleave assigns it; computing only that row (instead of all three,
    then selecting) is bit-identical and 3x cheaper. A 1-row [T] (or [1, T]) input means text-only,
    all rows equal. Pass inv_freq in float32: HF keeps it float32 even for bf16 checkpoints, and a
    bf16-rounded inv_freq visibly shifts large-position angles."""
    if positions.dim() == 1:
        positions = positions[None]
    half = inv_freq.shape[0]
    rows = _interleave_rows(tuple(int(s) for s in mrope_section), half, positions.device)
    if positions.shape[0] == 1:
        rows = torch.zeros_like(rows)
    # [T, half]: row rows[j] of the position ids, times inv_freq[j].
    pos = positions.index_select(0, rows).t()
    freqs = pos.float() * inv_freq.to(device=positions.device, dtype=torch.float)
    cos = freqs.cos() * attention_scaling
    sin = freqs.sin() * attention_scaling
    cos = torch.cat([cos, cos], dim=-1).to(dtype)
    sin = torch.cat([sin, sin], dim=-1).to(dtype)
    return cos, sin
