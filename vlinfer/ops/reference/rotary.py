"""Neox-style rotary position embedding on the queries and keys, in float32."""
import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox-style rotary on q [T, heads, D] and k [T, kv_heads, D] with cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    q_out = (q.float() * cos + rotate_half(q.float()) * sin).to(q.dtype)
    k_out = (k.float() * cos + rotate_half(k.float()) * sin).to(k.dtype)
    return q_out, k_out
