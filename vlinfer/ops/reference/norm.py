"""RMS norm, plain and fused with the residual add of a decoder layer, in float32 as transformers
computes it."""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (norm(x + residual), x + residual): the fused pre-norm step of a decoder layer."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
