"""Rotary position embedding with inverse frequencies computed the way transformers computes them for the
checkpoint's rope type (default, llama3, linear, dynamic ntk, yarn, ...)."""
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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_dim] each, float32: ops.apply_rotary rotates in float32 whatever the activation dtype."""
        return self.cos_cache[positions], self.sin_cache[positions]
