import torch
from torch import nn

from vlinfer.layers.context import ModelContext


class RMSNorm(nn.Module):
    def __init__(self, ctx: ModelContext, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.ops = ctx.ops
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual), the fused
        pre-norm."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
