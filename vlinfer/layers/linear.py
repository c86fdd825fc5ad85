"""Linear layers that know how to load their tensor-parallel shard. Each parameter carries a weight_loader that
takes the full checkpoint tensor (and, for fused layers, which part it is) and copies in this rank's slice."""
import torch
import torch.nn.functional as F
from torch import nn

from vlinfer.layers.distributed import all_reduce, divide, tp_rank, tp_size


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, shard_dim: int | None):
        super().__init__()
        self.shard_dim = shard_dim  # 0: output features are split across ranks, 1: input features, None: whole
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.shard_dim is not None and tp_size() > 1 and loaded.dim() > self.shard_dim and \
                not (param is self.bias and self.shard_dim == 1):
            size = param.shape[self.shard_dim]
            loaded = loaded.narrow(self.shard_dim, tp_rank() * size, size)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, tp_size()), bias, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul, e.g. gate and up."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        world = tp_size()
        offset = sum(self.output_sizes[:shard_id]) // world
        size = self.output_sizes[shard_id] // world
        loaded = loaded.narrow(0, tp_rank() * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its heads of each. shard_id is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        world = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, world)
        self.num_kv_heads = divide(num_kv_heads, world)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        loaded = loaded.narrow(0, tp_rank() * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed. The bias is added once, on rank 0."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, tp_size()), output_size, bias, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if tp_rank() == 0 else None)
        return all_reduce(y)
