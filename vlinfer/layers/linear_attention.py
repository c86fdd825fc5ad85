"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next (docs/hybrid.md): the
input projected to q, k, v (through a short depthwise causal conv with SiLU), the output gate z,
beta and the log-decay g; the gated delta rule over each sequence's recurrent state; a gated
RMSNorm per value head; the output projection. Its state (conv and recurrent) lives in the cache
pool's per-sequence slots (engine/cache_pool.py), read and written at the step's slots."""
import torch
import torch.nn.functional as F
from torch import nn

from vlinfer.layers.context import ModelContext
from vlinfer.layers.linear import MergedColumnParallelLinear, RowParallelLinear, as_tensor


class GatedDeltaNet(nn.Module):
    def __init__(self, ctx: ModelContext, config):
        super().__init__()
        if ctx.tp.size != 1:  # in_proj's q/k/v columns and the heads would need splitting apart
            raise NotImplementedError(
                "Gated DeltaNet layers (linear_attention in layer_types) run on one rank only; "
                f"tensor_parallel_size={ctx.tp.size} is not supported for them yet")
        check_linear_config(config)
        self.ctx, self.ops = ctx, ctx.ops
        self.num_k_heads, self.num_v_heads = (config.linear_num_key_heads,
                                              config.linear_num_value_heads)
        self.head_k_dim, self.head_v_dim = (config.linear_key_head_dim,
                                            config.linear_value_head_dim)
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        # the checkpoint's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a as one matmul
        self.in_proj = MergedColumnParallelLinear(
            ctx, config.hidden_size,
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads])
        self.conv1d = DepthwiseConvWeight(ctx, self.conv_dim, self.kernel_size)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=ctx.dtype),
                                    requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=ctx.dtype),
                                  requires_grad=False)
        for per_head in (self.dt_bias, self.A_log):  # one entry per value head
            per_head.weight_loader = sized_by(f"linear_num_value_heads={self.num_v_heads}")
        self.norm = GatedNormWeight(ctx, self.head_v_dim)
        self.norm.weight.weight_loader = sized_by(f"linear_value_head_dim={self.head_v_dim}")
        self.out_proj = RowParallelLinear(ctx, self.value_dim, config.hidden_size)
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


class DepthwiseConvWeight(nn.Module):
    """The conv1d's weight as the op reads it, [channels, kernel] (a holder: GatedDeltaNet passes
    it to ops.causal_conv1d); the checkpoint's is [channels, 1, kernel] (torch's Conv1d with
    groups=channels)."""

    def __init__(self, ctx: ModelContext, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel_size, dtype=ctx.dtype),
                                   requires_grad=False)
        self.weight.weight_loader = load_depthwise


def load_depthwise(param: nn.Parameter, loaded) -> None:
    """The checkpoint's [channels, 1, kernel] conv weight; one that does not fit names the config
    fields its kernel and channels come from."""
    tensor = as_tensor(loaded)
    if tensor.dim() == 3 and tensor.shape[1] == 1:
        tensor = tensor[:, 0]
    channels, kernel = param.shape
    if tensor.dim() == 2 and tensor.shape[1] != kernel:
        raise ValueError(f"the conv1d weight has a kernel of {tensor.shape[1]}, the checkpoint's "
                         f"config says linear_conv_kernel_dim={kernel}")
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"shape mismatch: conv1d weight {tuple(param.shape)}, checkpoint "
            f"{tuple(loaded.shape)}: its {channels} channels are 2 * linear_num_key_heads * "
            "linear_key_head_dim + linear_num_value_heads * linear_value_head_dim of the config")
    param.data.copy_(tensor)


def sized_by(fields: str):
    """A weight loader for a parameter whose one dimension is a config field (`fields` says which
    and its value): a checkpoint tensor of another size names it."""
    def load(param: nn.Parameter, loaded) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} ({fields} of the "
                             f"config), checkpoint {tuple(loaded.shape)}")
        param.data.copy_(as_tensor(loaded))
    return load


class GatedNormWeight(nn.Module):
    """The gated RMSNorm's weight (one per value-head channel; a holder: GatedDeltaNet passes it
    to ops.gated_rms_norm)."""

    def __init__(self, ctx: ModelContext, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=ctx.dtype), requires_grad=False)
