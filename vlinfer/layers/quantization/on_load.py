"""Quantize a dense checkpoint while loading (`LLM(model, quantization="int8" | "int4")`): for CPU
users who want the speed of int8 / int4 weights from a bf16 checkpoint. Weight-only and symmetric:
int8 per output channel (scale = max|w| / 127), int4 per group of 128 input features (scale = max|w|
/ 7, values in [-8, 7]). The language model's linear layers are quantized; the vision tower and the
LM head stay dense (the issue's rule: the vision tower is dense unless the checkpoint quantized it).
"""
import logging

import torch

from vlinfer.layers.quantization.base import (CheckpointQuantization, LinearMethod, ParamSpec,
                                              TensorIndex, dense_weight_layout)

logger = logging.getLogger("vlinfer")
# the first that divides the layer's input features (the CPU int4 kernel's sizes)
INT4_GROUP_SIZES = (128, 64, 32)
VISION_PREFIXES = ("model.visual.", "visual.")


def quantize_symmetric(weight: torch.Tensor, bits: int,
                       group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [N, K], float32 scales [N, G]) with w ~= q * scale, per group of group_size
    columns (None: per row). An all-zero group gets scale 0 and zeros."""
    n, k = weight.shape
    groups = 1 if group_size is None else k // group_size
    w = weight.float().reshape(n, groups, k // groups)
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().amax(-1, keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe).clamp_(-qmax - 1, qmax).to(torch.int8)
    return q.reshape(n, k), scale.reshape(n, groups)


class QuantizeOnLoadMethod(LinearMethod):
    def __init__(self, bits: int, group_size: int | None):
        self.bits, self.group_size = bits, group_size
        self.scheme = "w8a16" if bits == 8 else "w4a16"
        self.name = f"int{bits} on load"

    def signature(self) -> tuple:
        return (self.name, self.group_size)

    def describe(self) -> str:
        return (f"{self.name} "
                f"({'per channel' if self.group_size is None else f'group {self.group_size}'})")

    def create_weights(self, layer) -> dict[str, ParamSpec]:
        return {
            "weight": ParamSpec((layer.output_size, layer.input_size), layer.params_dtype,
                                dense_weight_layout())
        }

    def process_weights_after_loading(self, layer) -> bool:
        q, scale = quantize_symmetric(layer.weight.data, self.bits, self.group_size)
        del layer.weight
        layer.quantized = layer.ops.pack_quantized_linear(
            self.scheme, {"weight": q, "weight_scale": scale, "weight_zero": None})
        return True

    def apply(self, layer, x, bias):
        return layer.ops.weight_only_linear(x, layer.quantized, bias)

    def decode_weight(self, layer) -> dict | None:
        return {"scheme": self.scheme, "packed": layer.quantized}


class OnLoadQuantization(CheckpointQuantization):
    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"{kind} quantized on load"

    def expert_method_for(self, layer, prefix: str, tensors: TensorIndex) -> LinearMethod | None:
        # MoE experts stay dense: they are dequantized for the fused op, so quantizing them saves
        # nothing
        return None

    def method_for(self, layer, prefix: str, tensors: TensorIndex) -> LinearMethod | None:
        if prefix.startswith(VISION_PREFIXES):
            return None
        if self.kind == "int8":
            return QuantizeOnLoadMethod(8, None)
        k = layer.input_size
        group = next((g for g in INT4_GROUP_SIZES if k % g == 0), None)
        if group is None:
            logger.warning(
                "quantization=int4: %s stays dense (%d input features are not a multiple of 32)",
                prefix, k)
            return None
        return QuantizeOnLoadMethod(4, group)
