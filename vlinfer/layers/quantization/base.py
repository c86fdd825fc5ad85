"""The per-layer quantization interface. Every linear layer (layers/linear.py) holds one
LinearMethod: it declares the layer's parameters (named as the checkpoint names its tensors, e.g.
`weight`, `weight_scale`), says how each checkpoint tensor maps onto its parameter (ParamLayout:
which dim runs along output / input features, so fused shards and tensor-parallel slices are cut in
the right place, and how the file's encoding becomes the parameter's), repacks after loading for the
engine's op table, and runs the matmul through `layer.ops`.

Which method a layer gets is decided per layer from the checkpoint (a CheckpointQuantization, chosen
in detect.py): from the tensors actually present and the format's ignore list, never from a global
switch."""
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorInfo:
    """A checkpoint tensor's header: enough to choose a method without reading the data."""
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling: "I8", "I32", "BF16", "F32", "F8_E4M3", ...


class TensorIndex(dict):
    """checkpoint tensor name -> TensorInfo, for every tensor of the checkpoint (vlinfer.loading
    builds it)."""


@dataclass(frozen=True)
class ParamLayout:
    """How one checkpoint tensor of a shard maps onto a layer parameter.

    checkpoint_shape(out_features, in_features): the tensor's full shape in the file for one shard
    of out_features rows (a fused layer's q, k, v, gate or up; the whole layer otherwise) and the
    layer's full in_features. A tensor of any other shape is refused, naming it. output_dim /
    input_dim: the checkpoint tensor's dims that run along output / input features (None: it does
    not), in proportion (a packed int4 weight has K/8 columns, group scales K/g): fused shards and
    column-parallel ranks cut output_dim, row-parallel ranks cut input_dim; the parameter uses the
    same dims. per_shard: one value per fused shard (per-tensor scales): the parameter is
    [num_shards, ...] and shard i goes to row i; such a tensor is never cut. convert: checkpoint
    slice -> parameter encoding (unpacking int32 words, a dtype cast); None copies as is.
    convert_first: convert the whole checkpoint tensor, called convert(tensor, out_features,
    in_features) with the shard's full sizes, then cut the shard out of what it returned (for
    encodings that cannot be cut in place, e.g. FP8 block scales expanded to one row per output
    feature)."""
    checkpoint_shape: Callable[[int, int], tuple[int, ...]]
    output_dim: int | None = 0
    input_dim: int | None = 1
    per_shard: bool = False
    convert: Callable[..., torch.Tensor] | None = None
    convert_first: bool = False


@dataclass(frozen=True)
class ParamSpec:
    """A parameter a method asks its layer to hold: this rank's shape, its dtype, and its checkpoint
    layout; fill: its value before loading (None: uninitialized, every element must be loaded)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: ParamLayout
    fill: float | None = None


def dense_weight_layout() -> ParamLayout:
    return ParamLayout(lambda n, k: (n, k))


class LinearMethod:
    """How one linear layer holds and multiplies its weight. One instance per layer.

    The layer gives a method: layer.ops (the engine's op table), layer.tp, layer.input_size /
    output_size (this rank's), layer.full_input_size, layer.shard_output_sizes (this rank's rows of
    each fused shard, in order), layer.params_dtype (the model's compute dtype) and its parameters
    by name."""
    # Short name for logs and errors ("dense", "w8a16", "w4a16", "w8a8", ...).
    name = "dense"
    # Whether a fused layer of this method may also hold shards the checkpoint keeps dense (their
    # weights loaded as they are): methods that dequantize on load, whose result is dense anyway.
    hosts_dense_shards = False

    def signature(self) -> tuple:
        """What fused shards must agree on (scheme, bits, group size, ...): q, k and v of one layer
        (or gate and up) whose signatures differ cannot share one matmul, and loading fails naming
        the layer."""
        return (self.name,)

    def describe(self) -> str:
        return self.name

    def create_weights(self, layer) -> dict[str, ParamSpec]:
        """The parameters the layer holds besides `bias` (which stays the layer's, dense): name ->
        spec."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer) -> bool:
        """Once, after every tensor is loaded: convert to the op table's layout (layer.ops.pack_*).
        True when the layer now runs a packed / kernel layout (counted in the load log)."""
        return False

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def decode_weight(self, layer) -> dict | None:
        """The packed weight an op table's fused decode layers may take in place of `apply`
        (ops.dense_decode_stack: {"scheme", "packed"}, the op table judges it), or None: no fused
        form."""
        return None

    def dequantized_weight(self, layer) -> torch.Tensor:
        """The loaded weight as float32 [out, in], the checkpoint-form parameters freed: for
        consumers that run dense (the MoE experts, layers/fused_moe.py)."""
        raise ValueError(f"{self.describe()} weights cannot be dequantized")


class CheckpointQuantization:
    """A checkpoint format's rules for choosing each layer's method (compressed-tensors, FP8,
    msModelSlim, GGUF, quantize-on-load ...). detect.py picks one per checkpoint; assign.py asks it
    once per checkpoint shard of every linear layer, before any weight is read."""
    name = "dense"

    def method_for(self, layer, prefix: str, tensors: TensorIndex) -> LinearMethod | None:
        """The method for the checkpoint module `prefix` (e.g. "model.layers.0.self_attn.q_proj") of
        `layer`; None: dense. Raises ValueError naming the tensor when what is present does not fit
        the format."""
        return None

    def expert_method_for(self, layer, prefix: str, tensors: TensorIndex) -> LinearMethod | None:
        """The method for one MoE expert projection `prefix` (e.g.
        "model.layers.0.mlp.experts.3.gate_proj"), whose staging linear is `layer`
        (layers/fused_moe.py dequantizes what it loads). Formats store experts as they store linear
        layers."""
        return self.method_for(layer, prefix, tensors)

    def describe(self) -> str:
        return self.name
