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


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight is stored as an offset from one (Qwen3.5, Qwen3-Next:
    transformers scales by 1 + weight): loaded as 1 + weight, in float32 before the cast, so the
    forward is the plain RMSNorm."""

    def __init__(self, ctx: ModelContext, hidden_size: int, eps: float = 1e-6):
        super().__init__(ctx, hidden_size, eps)
        self.weight.weight_loader = load_offset_weight


def load_offset_weight(param: torch.nn.Parameter, loaded) -> None:
    loaded = loaded if isinstance(loaded, torch.Tensor) else loaded.full()
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(1.0 + loaded.float())
