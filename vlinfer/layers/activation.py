import torch
from torch import nn

from vlinfer.layers.context import ModelContext


class SiluAndMul(nn.Module):
    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.ops = ctx.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
