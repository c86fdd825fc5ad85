"""Integer-weight linear methods: weight-only W8A16 / W4A16 and W8A8 (int8 weights and int8
activations, dynamic per token or static per tensor). Each declares its parameters in the
checkpoint's own encoding (ParamLayout.convert turns packed int32 words into one int8 value per
entry while loading), and after loading hands quant_reference's canonical tensors (int8 weight [N,
K], weight_scale [N, G], weight_zero [N, G] or None, ...) to the op table's pack_quantized_linear,
which lays them out for its kernels. The layer keeps only what that returned."""
import logging

import torch

from vlinfer.layers.quantization.base import LinearMethod, ParamLayout, ParamSpec
from vlinfer.ops.reference.quant import dequantize_weight

logger = logging.getLogger("vlinfer")


def unpack_int32_rows(bits: int):
    """compressed-tensors' pack-quantized words -> int8 values: entry k of a row at bit k*bits,
    stored as value + 2^(bits-1); packed along dim 1 (weights) or dim 0 (zero points)."""
    def convert_dim1(words: torch.Tensor) -> torch.Tensor:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        shape = (words.shape[0], words.shape[1] * 32 // bits)
        return unpack_from_int32(words, bits, torch.Size(shape), packed_dim=1)
    return convert_dim1


def unpack_int32_cols(bits: int):
    def convert_dim0(words: torch.Tensor) -> torch.Tensor:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        shape = (words.shape[0] * 32 // bits, words.shape[1])
        return unpack_from_int32(words, bits, torch.Size(shape), packed_dim=0)
    return convert_dim0


def _groups(k: int, group_size: int | None) -> int:
    return 1 if group_size is None else k // group_size


class IntWeightMethod(LinearMethod):
    """Shared by the int methods: int8 values in `weight` (naive int8 files) or `weight_packed`
    (int32 words), scales per channel (group_size None), per group of group_size input features, or
    per tensor; integer zero points when asymmetric."""

    def __init__(self, bits: int, group_size: int | None, symmetric: bool, packed: bool,
                 per_tensor: bool = False):
        self.bits, self.group_size, self.symmetric, self.packed = \
            bits, group_size, symmetric, packed
        # one weight scale per shard (compressed-tensors strategy "tensor")
        self.per_tensor = per_tensor
        self.scheme = "w8a16" if bits == 8 else "w4a16"
        self.name = self.scheme

    def signature(self) -> tuple:
        return (self.name, self.bits, self.group_size, self.symmetric, self.packed, self.per_tensor)

    def describe(self) -> str:
        grouping = "per tensor" if self.per_tensor else \
            "per channel" if self.group_size is None else f"group {self.group_size}"
        return f"{self.name} ({'sym' if self.symmetric else 'asym'}, {grouping})"

    def _check_groups(self, layer) -> None:
        if self.group_size is not None and layer.input_size % self.group_size:
            raise ValueError(
                f"{self.describe()}: this rank's {layer.input_size} input features are not a whole "
                f"number of groups of {self.group_size}")

    def weight_specs(self, layer) -> dict[str, ParamSpec]:
        self._check_groups(layer)
        n, k = layer.output_size, layer.input_size
        g = self.group_size
        specs = {}
        if self.packed:
            bits = self.bits
            specs["weight_packed"] = ParamSpec((n, k), torch.int8, ParamLayout(
                lambda rows, cols: (rows, -(-cols * bits // 32)), convert=unpack_int32_rows(bits)))
            specs["weight_shape"] = ParamSpec((len(layer.shard_output_sizes), 2), torch.int64,
                                              ParamLayout(lambda rows, cols: (2, ), output_dim=None,
                                                          input_dim=None, per_shard=True))
        else:
            specs["weight"] = ParamSpec((n, k), torch.int8,
                                        ParamLayout(lambda rows, cols: (rows, cols)))
        if self.per_tensor:
            specs["weight_scale"] = ParamSpec(
                (len(layer.shard_output_sizes), 1), torch.float32,
                ParamLayout(lambda rows, cols: (1, ), output_dim=None, input_dim=None,
                            per_shard=True, convert=lambda t: t.float()))
        else:
            specs["weight_scale"] = ParamSpec((n, _groups(k, g)), torch.float32, ParamLayout(
                lambda rows, cols: (rows, _groups(cols, g)), input_dim=None if g is None else 1,
                convert=lambda t: t.float()))
        if not self.symmetric:
            if self.per_tensor:
                raise ValueError(
                    f"{self.describe()}: asymmetric per-tensor weights are not supported")
            if self.packed:
                bits = self.bits
                specs["weight_zero_point"] = ParamSpec((n, _groups(k, g)), torch.int8, ParamLayout(
                    lambda rows, cols: (-(-rows * bits // 32), _groups(cols, g)),
                    input_dim=None if g is None else 1, convert=unpack_int32_cols(bits)))
            else:
                specs["weight_zero_point"] = ParamSpec((n, _groups(k, g)), torch.int8, ParamLayout(
                    lambda rows, cols: (rows, _groups(cols, g)), input_dim=None if g is None else 1,
                    convert=lambda t: t.to(torch.int8)))
        return specs

    def create_weights(self, layer) -> dict[str, ParamSpec]:
        return self.weight_specs(layer)

    def canonical_weight(self, layer) -> dict:
        """The canonical int8 weight / scale / zero of this rank, checked; the checkpoint-form
        params are freed."""
        if self.packed:
            weight = layer.weight_packed.data
            shapes = layer.weight_shape.data
            full_rows = [layer.output_shard(shard)[4] for shard in _shard_ids(layer)]
            for i, rows in enumerate(full_rows):
                if tuple(shapes[i].tolist()) != (rows, layer.full_input_size):
                    raise ValueError(
                        f"weight_shape {tuple(shapes[i].tolist())} of shard {i} disagrees with the "
                        f"layer's {rows} x {layer.full_input_size}")
            del layer.weight_packed, layer.weight_shape
        else:
            weight = layer.weight.data
            del layer.weight
        scale = layer.weight_scale.data
        if self.per_tensor:
            scale = torch.cat(
                [scale[i].expand(rows, 1) for i, rows in enumerate(layer.shard_output_sizes)])
        del layer.weight_scale
        zero = None
        if not self.symmetric:
            zero = layer.weight_zero_point.data
            del layer.weight_zero_point
        return {
            "weight": weight.contiguous(), "weight_scale": scale.contiguous(), "weight_zero": zero
        }

    def process_weights_after_loading(self, layer) -> bool:
        layer.quantized = layer.ops.pack_quantized_linear(self.scheme, self.canonical_weight(layer))
        return True

    def dequantized_weight(self, layer) -> torch.Tensor:
        tensors = self.canonical_weight(layer)
        return dequantize_weight(tensors["weight"], tensors["weight_scale"], tensors["weight_zero"])

    def apply(self, layer, x, bias):
        return layer.ops.weight_only_linear(x, layer.quantized, bias)


def _shard_ids(layer) -> list:
    count = len(layer.shard_output_sizes)
    if count == 1:
        return [None]
    return list("qkv") if count == 3 and hasattr(layer, "total_sizes") else list(range(count))


class W8A8Method(IntWeightMethod):
    """int8 per-channel symmetric weights x int8 activations: per token, computed at run time
    (dynamic), or one calibrated scale (and zero point) per tensor (static). Fused shards of a
    static layer must share one input scale: they see the same input, so calibration gives them the
    same one."""

    def __init__(self, dynamic: bool, input_symmetric: bool = True,
                 per_tensor_weight: bool = False):
        super().__init__(8, None, True, packed=False, per_tensor=per_tensor_weight)
        self.dynamic, self.input_symmetric = dynamic, input_symmetric
        self.scheme = "w8a8_dynamic" if dynamic else "w8a8_static"
        self.name = "w8a8"

    def signature(self) -> tuple:
        return super().signature() + (self.dynamic, self.input_symmetric)

    def describe(self) -> str:
        acts = "dynamic per-token" if self.dynamic else \
            f"static per-tensor {'sym' if self.input_symmetric else 'asym'}"
        return (f"w8a8 (int8 weights per {'tensor' if self.per_tensor else 'channel'}, "
                f"{acts} int8 activations)")

    def create_weights(self, layer) -> dict[str, ParamSpec]:
        specs = self.weight_specs(layer)
        if not self.dynamic:
            shards = len(layer.shard_output_sizes)
            specs["input_scale"] = ParamSpec(
                (shards, 1), torch.float32,
                ParamLayout(lambda rows, cols: (1, ), output_dim=None, input_dim=None,
                            per_shard=True, convert=lambda t: t.float()))
            if not self.input_symmetric:
                specs["input_zero_point"] = ParamSpec((shards, 1), torch.float32, ParamLayout(
                    lambda rows, cols: (1,), output_dim=None, input_dim=None, per_shard=True,
                    convert=lambda t: t.float()))
        return specs

    def process_weights_after_loading(self, layer) -> bool:
        tensors = self.canonical_weight(layer)
        weight, weight_scale = tensors["weight"], tensors["weight_scale"]
        if self.dynamic:
            packed = {"weight": weight, "weight_scale": weight_scale}
        else:
            input_scale = layer.input_scale.data
            zero = layer.input_zero_point.data if not self.input_symmetric else torch.zeros_like(
                input_scale)
            if not (bool((input_scale == input_scale[0]).all()) and bool((zero == zero[0]).all())):
                raise ValueError(
                    f"{self.describe()}: the fused shards have different input scales / zero "
                    "points "
                    f"({input_scale.flatten().tolist()}, {zero.flatten().tolist()}); one matmul "
                    "needs one"
                )
            del layer.input_scale
            if not self.input_symmetric:
                del layer.input_zero_point
            zp = zero[0].reshape(1)
            packed = {
                "weight": weight,
                "input_scale": input_scale[0].reshape(1),
                "input_offset": zp,
                # x_q = round(x / s) + zp, so x_q @ W^T over-counts zp * sum_k W[n, k]: fold
                # it out.
                "quant_bias": (-zp * weight.sum(1, dtype=torch.int64).float()).round().to(
                    torch.int32),
                "deq_scale": (input_scale[0].float() * weight_scale.float().reshape(-1)),
                "weight_scale": weight_scale
            }
        layer.quantized = layer.ops.pack_quantized_linear(self.scheme, packed)
        return True

    def apply(self, layer, x, bias):
        if self.dynamic:
            return layer.ops.w8a8_dynamic_linear(x, layer.quantized, bias)
        return layer.ops.w8a8_static_linear(x, layer.quantized, bias)
