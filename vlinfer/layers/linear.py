"""Linear layers that know how to load their tensor-parallel shard. Each parameter carries a
weight_loader that takes the checkpoint tensor (and, for fused layers, which part it is) and copies
in this rank's slice.

The checkpoint tensor may be a lazy slice (loading.CheckpointSlice): `.narrow` on it reads only the
rows or columns asked for from the file, so a rank never reads more than its shard of a split
weight."""
import torch
from torch import nn

from vlinfer.layers.context import ModelContext
from vlinfer.layers.distributed import divide


def as_tensor(loaded) -> torch.Tensor:
    """A checkpoint tensor in full (reads a lazy slice whole: for weights every rank keeps entire).
    """
    return loaded if isinstance(loaded, torch.Tensor) else loaded.full()


def check_full_size(loaded, dim: int, expected: int) -> None:
    """A tensor about to be sliced must be whole first: narrowing a larger one would load part of it
    silently."""
    if loaded.shape[dim] != expected:
        raise ValueError(
            f"shape mismatch: checkpoint {tuple(loaded.shape)} has {loaded.shape[dim]} rows along "
            f"dim {dim}, the model expects {expected}")


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(as_tensor(loaded))


def _narrow_in_proportion(loaded, dim: int, start: int, length: int, full: int):
    """Cut rows start..start+length of `full` features out of a tensor whose `dim` holds them in
    proportion (a packed int4 weight has full/8 columns, group scales full/g): start and length must
    land on whole entries."""
    size = loaded.shape[dim]
    if (start * size) % full or (length * size) % full:
        raise ValueError(
            f"cannot cut features {start}..{start + length} of {full} out of a checkpoint tensor "
            "of "
            f"shape {tuple(loaded.shape)} (dim {dim} holds {size} entries for {full} features): "
            "the "
            "shard does not start on a whole packed word / scale group")
    return loaded.narrow(dim, start * size // full, length * size // full)


class LinearBase(nn.Module):
    """output_size and input_size are this rank's (already divided) sizes.

    A layer is dense (method None: `weight` in the model dtype, the op table's `linear`) until
    assign.py gives it a quantization method (layers/quantization/base.py) from the checkpoint; the
    method then declares the layer's parameters and runs its matmul. Parameters a method declares
    carry a `quant_layout` (ParamLayout) and load through `load_quantized`; dense ones through the
    loaders below, as before."""

    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, bias: bool,
                 shard_dim: int | None):
        super().__init__()
        self.ops = ctx.ops
        self.tp = ctx.tp  # the engine's group: collectives and shards follow it
        self.ctx = ctx  # the step's LoRA groups (layers/lora.py) are read from it
        self.lora = None  # LoRASlots once the engine enables LoRA on this layer
        # 0: output features are split across ranks, 1: input features, None: whole
        self.shard_dim = shard_dim
        self.input_size, self.output_size = input_size, output_size
        self.full_input_size = input_size * ctx.tp.size if shard_dim == 1 else input_size
        # this rank's rows of each fused shard (q, k, v / gate, up)
        self.shard_output_sizes = [output_size]
        self.params_dtype = ctx.dtype  # the model's dtype, from its engine's context
        self.method = None  # a quantization LinearMethod; None: dense
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=ctx.dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=ctx.dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if hasattr(param, "quant_layout"):
            return self.load_quantized(param, loaded)
        if self.shard_dim is not None and self.tp.size > 1 and len(loaded.shape) > self.shard_dim:
            size = param.shape[self.shard_dim]
            check_full_size(loaded, self.shard_dim, size * self.tp.size)
            loaded = loaded.narrow(self.shard_dim, self.tp.rank * size, size)
        default_weight_loader(param, loaded)

    # ---- quantized layers (layers/quantization) ----
    def set_method(self, method) -> None:
        """Hold the parameters `method` declares instead of the dense weight (before any weight is
        loaded)."""
        device = self.weight.device
        specs = method.create_weights(self)
        del self.weight
        for name, spec in specs.items():
            value = (torch.empty(spec.shape, dtype=spec.dtype, device=device) if spec.fill is None
                     else torch.full(spec.shape, spec.fill, dtype=spec.dtype, device=device))
            param = nn.Parameter(value, requires_grad=False)
            param.weight_loader = self.weight_loader
            param.quant_layout = spec.layout
            self.register_parameter(name, param)
        self.method = method

    def output_shard(self, shard_id) -> tuple[int, int, int, int, int]:
        """(shard index, first row in this rank's output, rows, first row in the checkpoint tensor,
        its rows)."""
        return 0, 0, self.output_size, 0, self.output_size

    def checkpoint_rows(self, shard_id) -> list[tuple[int, int]]:
        """(first row, rows) of each run of the checkpoint tensor `shard_id` that this rank holds,
        in the order its output keeps them: one run, unless a layer's shard interleaves parts
        (Gated DeltaNet's in_proj_qkv: this rank's q, k and v heads)."""
        _, _, rows, start, _ = self.output_shard(shard_id)
        return [(start, rows)]

    def take_rows(self, loaded, shard_id, dim: int, full_rows: int):
        """This rank's rows (checkpoint_rows) of a checkpoint tensor whose `dim` holds full_rows
        output features in proportion; lazy when they are one run."""
        parts = [_narrow_in_proportion(loaded, dim, start, rows, full_rows)
                 for start, rows in self.checkpoint_rows(shard_id)]
        return parts[0] if len(parts) == 1 else torch.cat([as_tensor(p) for p in parts], dim)

    def input_shard(self) -> tuple[int, int, int]:
        """(first column in the checkpoint tensor, columns this rank holds, the tensor's columns).
        """
        if self.shard_dim == 1 and self.tp.size > 1:
            return self.tp.rank * self.input_size, self.input_size, self.full_input_size
        return 0, self.input_size, self.input_size

    def load_quantized(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """Load one checkpoint tensor of a shard into a method-declared parameter, following its
        ParamLayout."""
        layout = param.quant_layout
        index, offset, rows, start, full_rows = self.output_shard(shard_id)
        col_start, cols, full_cols = self.input_shard()
        expected = tuple(layout.checkpoint_shape(full_rows, full_cols))
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(loaded.shape)}, {self.method.describe()} "
                "expects "
                f"{expected} for {full_rows} output x {full_cols} input features")
        if layout.convert_first:
            loaded = layout.convert(as_tensor(loaded), full_rows, full_cols)
        if not layout.per_shard:
            if layout.output_dim is not None and rows != full_rows:
                loaded = self.take_rows(loaded, shard_id, layout.output_dim, full_rows)
            if layout.input_dim is not None and cols != full_cols:
                loaded = _narrow_in_proportion(loaded, layout.input_dim, col_start, cols, full_cols)
        tensor = as_tensor(loaded)
        if layout.convert is not None and not layout.convert_first:
            tensor = layout.convert(tensor)
        target = param.data
        if layout.per_shard:
            target = target[index]
        elif layout.output_dim is not None and rows != self.output_size:
            per_row = param.shape[layout.output_dim] / self.output_size
            target = target.narrow(layout.output_dim, round(offset * per_row),
                                   round(rows * per_row))
        default_weight_loader(target, tensor)

    def pack_weight(self, large_rows: bool = False) -> bool:
        """Replace the weight by the op table's preferred layout, once, after loading; False when it
        has none. large_rows: this layer only ever runs prefill-sized row counts (ops
        pack_linear_weight)."""
        if self.method is not None:
            return self.method.process_weights_after_loading(self)
        packed = self.ops.pack_linear_weight(self.weight, large_rows)
        if packed is None:
            return False
        # the plain weight is freed with the old one
        self.weight = nn.Parameter(packed, requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method is not None:
            return self.with_lora(x, self.method.apply(self, x, self.bias))
        return self.with_lora(x, self.ops.linear(x, self.weight, self.bias))

    def with_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus the step's adapter updates (layers/lora.py), when this layer has LoRA slots and
        adapters run."""
        step = self.ctx.step
        if self.lora is None or step is None or step.lora is None:
            return y
        return self.lora.add_to(x, y, step.lora)


class ReplicatedLinear(LinearBase):
    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, bias: bool = False):
        super().__init__(ctx, input_size, output_size, bias, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, bias: bool = False):
        super().__init__(ctx, input_size, divide(output_size, ctx.tp.size), bias, 0)

    def output_shard(self, shard_id):
        size = self.output_size
        return 0, 0, size, self.tp.rank * size, size * self.tp.size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul, e.g. gate and up: each
    rank holds its slice of each, side by side ([gate_r | up_r]), so the activation splits the local
    output in half."""

    def __init__(self, ctx: ModelContext, input_size: int, output_sizes: list[int],
                 bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(ctx, input_size, sum(output_sizes), bias)
        self.shard_output_sizes = [divide(size, ctx.tp.size) for size in output_sizes]

    def output_shard(self, shard_id: int):
        world = self.tp.size
        size = divide(self.output_sizes[shard_id], world)
        return shard_id, sum(self.output_sizes[:shard_id]) // world, size, self.tp.rank * size, \
            self.output_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        if hasattr(param, "quant_layout"):
            return self.load_quantized(param, loaded, shard_id)
        _, offset, size, _, full_rows = self.output_shard(shard_id)
        check_full_size(loaded, 0, full_rows)
        loaded = self.take_rows(loaded, shard_id, 0, full_rows)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class QKVParallelLinear(LinearBase):
    """q, k and v projections fused; each rank holds its query heads and the KV heads they attend
    to. shard_id is "q", "k" or "v".

    Query heads split evenly. KV heads split evenly when there are at least as many as ranks; with
    fewer (GQA / MQA at high TP, e.g. 1 KV head on 2 ranks) each rank holds the single KV head of
    its query heads' group, replicated on tp / num_kv_heads ranks: rank r's query heads [r*h/tp,
    (r+1)*h/tp) all belong to KV group r*kv//tp exactly when tp is a multiple of kv."""

    def __init__(self, ctx: ModelContext, hidden_size: int, head_dim: int, num_heads: int,
                 num_kv_heads: int, bias: bool = False):
        tp = ctx.tp
        self.head_dim = head_dim
        self.total_sizes = {
            "q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim
        }
        self.num_heads = divide(num_heads, tp.size)
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size)
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size={tp.size} must be a multiple of "
                                 f"num_key_value_heads={num_kv_heads}")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        super().__init__(ctx, hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim,
                         bias, 0)
        self.shard_output_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim,
                                   self.num_kv_heads * head_dim]

    def output_shard(self, shard_id: str):
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        kv_start = self.kv_head_start * self.head_dim
        offset, size, start = {
            "q": (0, q_size, self.tp.rank * q_size), "k": (q_size, kv_size, kv_start),
            "v": (q_size + kv_size, kv_size, kv_start)
        }[shard_id]
        return "qkv".index(shard_id), offset, size, start, self.total_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        if hasattr(param, "quant_layout"):
            return self.load_quantized(param, loaded, shard_id)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        kv_start = self.kv_head_start * self.head_dim
        offset, size, start = {
            "q": (0, q_size, self.tp.rank * q_size), "k": (q_size, kv_size, kv_start),
            "v": (q_size + kv_size, kv_size, kv_start)
        }[shard_id]
        check_full_size(loaded, 0, self.total_sizes[shard_id])
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed. The bias is added once, on
    rank 0."""

    def __init__(self, ctx: ModelContext, input_size: int, output_size: int, bias: bool = False):
        super().__init__(ctx, divide(input_size, ctx.tp.size), output_size, bias, 1)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param is self.bias:  # whole on every rank (used on rank 0 only)
            default_weight_loader(param, loaded)
        else:
            super().weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        if self.method is not None:
            return self.tp.all_reduce(self.with_lora(x, self.method.apply(self, x, bias)))
        y = self.ops.linear(x, self.weight, bias)
        return self.tp.all_reduce(self.with_lora(x, y))
