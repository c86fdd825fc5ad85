"""The dense linear layer's op: y = x @ weight.T + bias. Implementations may run it on a weight they
laid out once after loading (Backend.pack_linear_weight)."""
import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
