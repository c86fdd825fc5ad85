"""The MLP activations: SiLU-and-multiply over a merged gate_up projection, and tanh-approximated
GELU."""
import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU (gelu_pytorch_tanh). Implementations may overwrite x: callers pass a
    temporary."""
    return F.gelu(x, approximate="tanh")
