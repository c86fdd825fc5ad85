"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next (docs/hybrid.md): the
input projected to q, k, v (through a short depthwise causal conv with SiLU), the output gate z,
beta and the log-decay g; the gated delta rule over each sequence's recurrent state; a gated
RMSNorm per value head; the output projection. Its state (conv and recurrent) lives in the cache
pool's per-sequence slots (engine/cache_pool.py), read and written at the step's slots."""
import torch
import torch.nn.functional as F
from torch import nn

from vlinfer.layers.context import ModelContext
from vlinfer.layers.distributed import SINGLE, TPGroup, divide
from vlinfer.layers.linear import MergedColumnParallelLinear, RowParallelLinear, as_tensor


class GatedDeltaNet(nn.Module):
    """Under tensor parallelism each rank holds whole key heads and the value heads they serve:
    their q / k / v channels (in_proj_qkv's rows and the conv's), z, b, a, A_log and dt_bias, the
    out_proj columns of its value heads, and the state of those heads only."""

    def __init__(self, ctx: ModelContext, config):
        super().__init__()
        check_linear_config(config)
        self.ctx, self.ops = ctx, ctx.ops
        tp = ctx.tp.size  # distributed/shapes.py checked linear_num_key_heads splits
        self.num_k_heads = divide(config.linear_num_key_heads, tp)
        self.num_v_heads = divide(config.linear_num_value_heads, tp)
        self.head_k_dim, self.head_v_dim = (config.linear_key_head_dim,
                                            config.linear_value_head_dim)
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        # the checkpoint's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a as one matmul
        self.in_proj = DeltaNetInProj(ctx, config.hidden_size, self.key_dim, self.value_dim,
                                      self.num_v_heads)
        self.conv1d = DepthwiseConvWeight(ctx, self.conv_dim, self.kernel_size,
                                          self.in_proj.checkpoint_rows(0))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=ctx.dtype),
                                    requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=ctx.dtype),
                                  requires_grad=False)
        for per_head in (self.dt_bias, self.A_log):  # one entry per value head
            per_head.weight_loader = sized_by(
                f"linear_num_value_heads={config.linear_num_value_heads}", ctx.tp)
        self.norm = GatedNormWeight(ctx, self.head_v_dim)
        self.norm.weight.weight_loader = sized_by(f"linear_value_head_dim={self.head_v_dim}",
                                                  SINGLE)  # whole on every rank
        self.out_proj = RowParallelLinear(ctx, self.value_dim * tp, config.hidden_size)
        # one slot's conv state and recurrent state (HasStateSlots). The conv state holds past
        # inputs, already in the compute dtype: kept in it, losslessly (vLLM's mamba_cache_dtype
        # "auto"); the recurrent state in ctx.state_dtype (mamba_ssm_cache_dtype).
        self.state_shapes = ((self.conv_dim, self.kernel_size - 1),
                             (self.num_v_heads, self.head_k_dim, self.head_v_dim))
        self.state_dtypes = (ctx.dtype, ctx.state_dtype)
        # [num_slots, *shape] views of the cache pool, bound by it
        self.states: tuple[torch.Tensor, ...] = ()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        step = self.ctx.forward_context()
        if not self.states:
            raise RuntimeError("a Gated DeltaNet layer ran with no state slots bound")
        conv_state, recurrent_state = self.states
        n = len(hidden_states)
        qkv, z, b, a = self.in_proj(hidden_states).split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], -1)
        cu, slots, has_state = step.state_cu_seqlens, step.state_slots, step.has_state
        qkv = self.ops.causal_conv1d(qkv.contiguous(), self.conv1d.weight, None, conv_state, cu,
                                     slots, has_state)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q = q.reshape(n, self.num_k_heads, self.head_k_dim)
        k = k.reshape(n, self.num_k_heads, self.head_k_dim)
        v = v.reshape(n, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        # float32 as transformers computes it: a 16-bit A_log's exp may overflow
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = self.ops.gated_delta_rule(q, k, v, g, beta, recurrent_state, cu, slots, has_state,
                                      self.head_k_dim**-0.5)
        o = self.ops.gated_rms_norm(o, z.reshape(n, self.num_v_heads, self.head_v_dim),
                                    self.norm.weight, self.eps)
        return self.out_proj(o.reshape(n, self.value_dim))


def check_linear_config(config) -> None:
    """The linear layers' sizes from the config, or a clear error naming the field."""
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"the checkpoint's {name}={value!r} is not a positive int")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(
            f"the checkpoint's linear_num_value_heads={config.linear_num_value_heads} is not a "
            f"multiple of linear_num_key_heads={config.linear_num_key_heads}: each key head serves "
            "a group of value heads")
    if config.linear_conv_kernel_dim < 2:
        raise ValueError(f"the checkpoint's linear_conv_kernel_dim="
                         f"{config.linear_conv_kernel_dim}: the causal conv needs a kernel of 2 "
                         "or more (its state keeps kernel - 1 inputs)")


class DeltaNetInProj(MergedColumnParallelLinear):
    """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (shards 0..3) of one rank's heads in one
    matmul: [q | k | v | z | b | a] of its key heads and the value heads they serve. Its qkv rows
    are three runs of the checkpoint's in_proj_qkv (its q heads, its k heads, its v heads)."""

    def __init__(self, ctx: ModelContext, hidden_size: int, key_dim: int, value_dim: int,
                 num_v_heads: int):
        self.key_dim, self.value_dim = key_dim, value_dim  # this rank's
        tp = ctx.tp.size
        super().__init__(ctx, hidden_size, [tp * (2 * key_dim + value_dim), tp * value_dim,
                                            tp * num_v_heads, tp * num_v_heads])

    def checkpoint_rows(self, shard_id) -> list[tuple[int, int]]:
        if shard_id != 0:
            return super().checkpoint_rows(shard_id)
        rank, tp, kd, vd = self.tp.rank, self.tp.size, self.key_dim, self.value_dim
        return [(rank * kd, kd), (tp * kd + rank * kd, kd), (2 * tp * kd + rank * vd, vd)]


class DepthwiseConvWeight(nn.Module):
    """The conv1d's weight as the op reads it, [channels, kernel] (a holder: GatedDeltaNet passes
    it to ops.causal_conv1d); the checkpoint's is [channels, 1, kernel] (torch's Conv1d with
    groups=channels). runs: (first channel, channels) of the checkpoint's this rank holds (its q,
    k and v heads'), in order."""

    def __init__(self, ctx: ModelContext, channels: int, kernel_size: int,
                 runs: list[tuple[int, int]]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel_size, dtype=ctx.dtype),
                                   requires_grad=False)
        self.weight.weight_loader = lambda param, loaded: load_depthwise(param, loaded, runs,
                                                                         ctx.tp.size)


def load_depthwise(param: nn.Parameter, loaded, runs: list[tuple[int, int]], tp: int) -> None:
    """The checkpoint's [channels, 1, kernel] conv weight, this rank's channels; one that does not
    fit names the config fields its kernel and channels come from."""
    tensor = dense(as_tensor(loaded), "the conv1d weight")
    if tensor.dim() == 3 and tensor.shape[1] == 1:
        tensor = tensor[:, 0]
    channels, kernel = param.shape
    if tensor.dim() == 2 and tensor.shape[1] != kernel:
        raise ValueError(f"the conv1d weight has a kernel of {tensor.shape[1]}, the checkpoint's "
                         f"config says linear_conv_kernel_dim={kernel}")
    if tuple(tensor.shape) != (channels * tp, kernel):
        raise ValueError(
            f"shape mismatch: conv1d weight {(channels * tp, kernel)}, checkpoint "
            f"{tuple(loaded.shape)}: its {channels * tp} channels are 2 * linear_num_key_heads * "
            "linear_key_head_dim + linear_num_value_heads * linear_value_head_dim of the config")
    param.data.copy_(torch.cat([tensor[start:start + n] for start, n in runs]))


def sized_by(fields: str, tp: TPGroup):
    """A weight loader for a one-dimensional parameter sized by a config field (`fields` names it
    and its value), split over `tp` (SINGLE: whole on every rank): this rank's entries; a
    checkpoint tensor of another size names the field."""
    def load(param: nn.Parameter, loaded) -> None:
        size = len(param)
        if tuple(loaded.shape) != (size * tp.size,):
            raise ValueError(f"shape mismatch: parameter {(size * tp.size,)} ({fields} of the "
                             f"config), checkpoint {tuple(loaded.shape)}")
        param.data.copy_(dense(as_tensor(loaded.narrow(0, tp.rank * size, size)),
                               f"the tensor sized by {fields}"))
    return load


def dense(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """A checkpoint tensor of a part that stays dense (conv1d, A_log, dt_bias, the gated norm): an
    integer or 8-bit float one (a quantized checkpoint that quantized it) is refused by name."""
    if not tensor.is_floating_point() or tensor.element_size() < 2:
        raise ValueError(f"{what} is stored as {tensor.dtype}: Gated DeltaNet's conv1d, A_log, "
                         "dt_bias and gated norm stay dense (16- or 32-bit floats)")
    return tensor


class GatedNormWeight(nn.Module):
    """The gated RMSNorm's weight (one per value-head channel; a holder: GatedDeltaNet passes it
    to ops.gated_rms_norm)."""

    def __init__(self, ctx: ModelContext, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=ctx.dtype), requires_grad=False)
