"""Ascend msModelSlim checkpoints (what vllm-ascend serves with `--quantization ascend`):
safetensors plus `quant_model_description.json`, a flat map "<tensor name>": "<type>" with
"model_quant_type" (and "version", "kv_cache_type", ...). A linear's type is the one of its
"<prefix>.weight"; fused q/k/v and gate/up shards must agree (assign.py). msModelSlim quantizes
parts of the Qwen3-VL vision tower too: those layers get a method the same way, the others stay
FLOAT (dense).

Types and tensors (msModelSlim's weight-format description; the shared quantization note,
quantization.md §1b):
- FLOAT: dense.
- W8A16: `weight` int8 [N, K]; `weight_scale`, `weight_offset` [N] or [N, 1] (per channel) or [N,
  K/g] (per group);
  weight = (weight - weight_offset) * weight_scale.
- W8A8_DYNAMIC: `weight` int8 [N, K], `weight_scale` / `weight_offset` [N, 1]; activations int8 per
  token at run
  time (symmetric: weight_offset must be 0, as vllm-ascend assumes).
- W8A8 (static): `weight`, `input_scale` [1], `input_offset` [1], `quant_bias` int32 [N],
  `deq_scale` [N] (float32;
  int64 in float16 models: the float32 bits in the low 32 bits), optionally `weight_scale` /
  `weight_offset`.
  x_q = x / input_scale + input_offset; y = (x_q @ weight^T + quant_bias) * deq_scale. The float
  bias is folded
  into quant_bias (vllm-ascend never adds the layer's bias for this type), so a `.bias` tensor, if
  the file holds
  one, is loaded but not added; without one the layer has no bias.
Anything else (W4A8_DYNAMIC, W8A8_MIX, sparse types, FA quantization) is refused naming it.
kv_cache_type C8 (an
int8 KV cache with static per-channel scales) is the KV cache's: kv_cache.py reads it.
Layers run on any device through the engine's op table (ops/reference/quant.py defines the math;
ops/npu/quant.py runs torch_npu's calls, ops/cuda/quant.py our Triton kernels).
"""
import json
import logging
import os

import torch

from vlinfer.layers.quantization.base import (CheckpointQuantization, LinearMethod, ParamLayout,
                                              ParamSpec, TensorIndex)

logger = logging.getLogger("vlinfer")
DESCRIPTION_FILE = "quant_model_description.json"
LINEAR_TYPES = ("W8A8", "W8A8_DYNAMIC", "W8A16")
# Description keys that are not tensors.
META_KEYS = ("version", "model_quant_type", "kv_cache_type", "fa_quant_type", "indexer_quant_type",
             "group_size", "reduce_quant_type", "metadata")


def detect_modelslim(hf_config, folder: str | None,
                     tensors: TensorIndex) -> "ModelSlimQuantization | None":
    """A DETECTORS entry (detect.py): an msModelSlim checkpoint has quant_model_description.json
    next to its safetensors."""
    if folder is None:
        return None
    path = os.path.join(folder, DESCRIPTION_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            description = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable msModelSlim description ({e})") from None
    if not isinstance(description, dict):
        raise ValueError(
            f"{path}: expected a JSON object mapping tensor names to quantization types")
    return ModelSlimQuantization(description, path)


class ModelSlimQuantization(CheckpointQuantization):
    name = "msModelSlim"

    def __init__(self, description: dict, path: str = DESCRIPTION_FILE):
        self.description, self.path = description, path
        for key in ("kv_cache_type", "fa_quant_type", "indexer_quant_type"):
            if description.get(key) not in (None, "", "FLOAT") and (key, description[key]) != (
                    "kv_cache_type", "C8"):
                raise ValueError(
                    f"{path}: {key}={description[key]!r} (quantized KV cache / attention) is not "
                    "supported; vlinfer loads msModelSlim W8A8, W8A8_DYNAMIC, W8A16 and FLOAT "
                    "linears"
                )
        self.model_type = description.get("model_quant_type", "?")
        for key, kind in description.items():
            # The LM head and embeddings are not linear layers here: a quantized one would load as
            # garbage.
            if key.endswith(("lm_head.weight", "embed_tokens.weight")) and kind != "FLOAT":
                raise ValueError(
                    f"{path}: {key} is {kind}; vlinfer runs the LM head and embeddings dense "
                    "(FLOAT)"
                )

    def describe(self) -> str:
        return f"msModelSlim {self.model_type}"

    def method_for(self, layer, prefix: str, tensors: TensorIndex) -> LinearMethod | None:
        key = f"{prefix}.weight"
        kind = self.description.get(key)
        info = tensors.get(key)
        if kind is None or kind == "FLOAT":
            if info is not None and info.dtype.startswith(("I", "U")):
                raise ValueError(
                    f"{key}: integer tensor ({info.dtype}) but {DESCRIPTION_FILE} marks it "
                    f"{kind or 'absent'}, not a quantized type")
            return None
        if kind not in LINEAR_TYPES:
            raise ValueError(
                f"{key}: msModelSlim type {kind!r} is not supported (supported: FLOAT, "
                f"{', '.join(LINEAR_TYPES)})")
        if info is None or info.dtype != "I8":
            raise ValueError(f"{key}: {kind} needs an int8 weight, the checkpoint has "
                             f"{'none' if info is None else info.dtype}")
        needed = {
            "W8A16": ("weight_scale", "weight_offset"),
            "W8A8_DYNAMIC": ("weight_scale", "weight_offset"),
            "W8A8": ("input_scale", "input_offset", "quant_bias", "deq_scale")
        }[kind]
        missing = [f"{prefix}.{name}" for name in needed if f"{prefix}.{name}" not in tensors]
        if missing:
            raise ValueError(f"{prefix}: {kind} layer is missing tensors {missing}")
        shapes = {
            name: tensors[f"{prefix}.{name}"].shape
            for name in ("weight_scale", "weight_offset", "deq_scale")
            if f"{prefix}.{name}" in tensors
        }
        return ModelSlimLinear(kind, prefix, shapes, info.shape[1], has_bias=f"{prefix}.bias"
                               in tensors)


def _per_row_layout(file_shape: tuple, k: int):
    """[N], [N, 1] or [N, G] per-row tensors: the file's own rank, groups cut with the input
    features."""
    if len(file_shape) == 1:
        return ParamLayout(lambda rows, cols: (rows, ), input_dim=None,
                           convert=lambda t: t.float().reshape(-1, 1))
    groups = file_shape[1]
    if groups == 1:
        return ParamLayout(lambda rows, cols: (rows, 1), input_dim=None,
                           convert=lambda t: t.float())
    group_size = k // groups
    return ParamLayout(lambda rows, cols: (rows, cols // group_size), input_dim=1,
                       convert=lambda t: t.float())


def _deq_scale(t: torch.Tensor) -> torch.Tensor:
    """deq_scale as float32: int64 files (float16 models) carry the float32 bits in the low 32 bits.
    """
    if t.dtype == torch.int64:
        return (t & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return t.float()


class ModelSlimLinear(LinearMethod):
    """One msModelSlim linear type; `file_shapes` are the scale tensors' shapes in the file (1-D or
    2-D, groups)."""

    def __init__(self, kind: str, prefix: str, file_shapes: dict, full_in_features: int,
                 has_bias: bool):
        self.kind, self.prefix, self.file_shapes, self.has_bias = \
            kind, prefix, file_shapes, has_bias
        self.full_in_features = full_in_features
        scale = file_shapes.get("weight_scale")
        self.groups = 1 if scale is None or len(scale) == 1 else scale[1]
        self.name = kind.lower()
        self.scheme = {"W8A8": "w8a8_static", "W8A8_DYNAMIC": "w8a8_dynamic",
                       "W8A16": "w8a16"}[kind]

    def signature(self) -> tuple:
        return (self.kind, self.groups,
                tuple(sorted((k, len(v)) for k, v in self.file_shapes.items())), self.has_bias)

    def describe(self) -> str:
        grouping = f", group {self.full_in_features // self.groups}" if self.groups > 1 else ""
        return f"msModelSlim {self.kind}{grouping}"

    def create_weights(self, layer) -> dict[str, ParamSpec]:
        n, k = layer.output_size, layer.input_size
        if self.groups > 1 and k % (self.full_in_features // self.groups):
            raise ValueError(
                f"{self.prefix}: this rank's {k} input features are not whole groups of "
                f"{self.full_in_features // self.groups}")
        shards = len(layer.shard_output_sizes)
        specs = {
            "weight": ParamSpec((n, k), torch.int8, ParamLayout(lambda rows, cols: (rows, cols)))
        }
        for name in ("weight_scale", "weight_offset"):
            if name in self.file_shapes:
                columns = self.groups * k // self.full_in_features if self.groups > 1 else 1
                specs[name] = ParamSpec((n, columns), torch.float32,
                                        _per_row_layout(self.file_shapes[name],
                                                        self.full_in_features))
        if self.kind == "W8A8":
            for name in ("input_scale", "input_offset"):
                specs[name] = ParamSpec((shards, 1), torch.float32, ParamLayout(
                    lambda rows, cols: (1,), output_dim=None, input_dim=None, per_shard=True,
                    convert=lambda t: t.float()))
            specs["quant_bias"] = ParamSpec((n,), torch.int32, ParamLayout(
                lambda rows, cols: (rows,), input_dim=None, convert=lambda t: t.to(torch.int32)))
            deq_rank = len(self.file_shapes.get("deq_scale", (0,)))
            specs["deq_scale"] = ParamSpec(
                (n, ), torch.float32,
                ParamLayout((lambda rows, cols: (rows, )) if deq_rank == 1 else (lambda rows, cols:
                                                                                 (rows, 1)),
                            input_dim=None, convert=lambda t: _deq_scale(t).reshape(-1)))
            if not self.has_bias and layer.bias is not None:
                layer.register_parameter("bias", None)  # the float bias lives in quant_bias
        return specs

    def process_weights_after_loading(self, layer) -> bool:
        weight = layer.weight.data.contiguous()
        scale = layer.weight_scale.data if hasattr(layer, "weight_scale") else None
        offset = layer.weight_offset.data if hasattr(layer, "weight_offset") else None
        for name in ("weight", "weight_scale", "weight_offset"):
            if hasattr(layer, name):
                delattr(layer, name)
        if self.kind == "W8A16":
            zero = None if not bool(offset.any()) else offset.contiguous()
            tensors = {"weight": weight, "weight_scale": scale.contiguous(), "weight_zero": zero}
        elif self.kind == "W8A8_DYNAMIC":
            if bool(offset.any()):
                raise ValueError(
                    f"{self.prefix}.weight_offset: W8A8_DYNAMIC with asymmetric (non-zero offset) "
                    "weights is not supported")
            tensors = {"weight": weight, "weight_scale": scale.contiguous()}
        else:
            tensors = self._static_tensors(layer, weight)
        layer.quantized = layer.ops.pack_quantized_linear(self.scheme, tensors)
        return True

    def _static_tensors(self, layer, weight) -> dict:
        input_scale, input_offset = layer.input_scale.data, layer.input_offset.data
        if not (bool((input_scale == input_scale[0]).all()) and bool(
            (input_offset == input_offset[0]).all())):
            raise ValueError(
                f"{self.prefix}: the fused shards have different input_scale / input_offset "
                f"({input_scale.flatten().tolist()}, {input_offset.flatten().tolist()}); one "
                "matmul "
                "needs one")
        quant_bias = layer.quant_bias.data
        row_parallel = layer.shard_dim == 1 and layer.tp.size > 1
        if row_parallel:
            # Each rank multiplies its slice of K; quant_bias holds the bias and the offset's
            # correction over the whole K, so it is added once (rank 0, as vllm-ascend does), which
            # is right only for a zero offset.
            if bool(input_offset.any()):
                raise ValueError(
                    f"{self.prefix}: a W8A8 layer with a non-zero input_offset cannot be split "
                    "along "
                    "its input features (tensor parallel row-parallel layer)")
            if layer.tp.rank != 0:
                quant_bias = torch.zeros_like(quant_bias)
        tensors = {
            "weight": weight, "input_scale": input_scale[0].reshape(1),
            "input_offset": input_offset[0].reshape(1), "quant_bias": quant_bias.contiguous(),
            "deq_scale": layer.deq_scale.data.contiguous()
        }
        for name in ("input_scale", "input_offset", "quant_bias", "deq_scale"):
            delattr(layer, name)
        return tensors

    def apply(self, layer, x, bias):
        if self.kind == "W8A8_DYNAMIC":
            return layer.ops.w8a8_dynamic_linear(x, layer.quantized, bias)
        if self.kind == "W8A8":
            # the bias is folded into quant_bias
            return layer.ops.w8a8_static_linear(x, layer.quantized, None)
        return layer.ops.weight_only_linear(x, layer.quantized, bias)
