"""compressed-tensors checkpoints (llm-compressor's output, what vLLM serves):
`quantization_config.quant_method == "compressed-tensors"`. The config is read with the
compressed-tensors package itself; a layer's scheme comes from the config group whose targets match
it (and the ignore list), and the tensors present must agree with it.

Supported (each to its documented tensor layout):
- int-quantized W8A8: int8 `weight` per channel (symmetric), activations int8 per token (dynamic) or
  per tensor
  (static `input_scale`, `input_zero_point` when asymmetric).
- pack-quantized W4A16 / W8A16: int32 `weight_packed` words, `weight_scale` per group (or per
  channel for 8-bit),
  `weight_shape`, packed `weight_zero_point` when asymmetric.
- int-quantized weight-only int8 (naive `weight` int8 without activation quantization): W8A16.
Anything else (float schemes, actorder g_idx, sparsity, transforms) is refused naming the group and
what it holds.
A `kv_cache_scheme` is the KV cache's, not a linear's: kv_cache.py reads it."""
import logging

from vlinfer.layers.quantization.base import CheckpointQuantization, LinearMethod, TensorIndex
from vlinfer.layers.quantization.int_weights import IntWeightMethod, W8A8Method

logger = logging.getLogger("vlinfer")
SUPPORTED_FORMATS = ("int-quantized", "pack-quantized", "naive-quantized")


def _name(value, default: str) -> str:
    """An enum field of compressed-tensors' config (a str Enum, a plain str, or None) as its string
    value."""
    if value is None:
        return default
    return str(getattr(value, "value", value))


class CompressedTensorsQuantization(CheckpointQuantization):
    name = "compressed-tensors"

    def __init__(self, quantization_config: dict):
        from compressed_tensors.quantization import QuantizationConfig
        try:
            self.config = QuantizationConfig.model_validate(quantization_config)
        except Exception as e:
            raise ValueError(
                f"quantization_config (compressed-tensors) is not valid: {str(e).splitlines()[0]}"
            ) from e
        if quantization_config.get("sparsity_config"):
            raise ValueError(
                "quantization_config: compressed-tensors sparsity_config is not supported")
        if quantization_config.get("transform_config"):
            raise ValueError(
                "quantization_config: compressed-tensors transform_config is not supported")
        self.ignore = list(self.config.ignore or [])
        self.groups = {}
        for group_name, scheme in self.config.config_groups.items():
            fmt = scheme.format or self.config.format
            self._check_scheme(group_name, scheme, fmt)
            self.groups[group_name] = (scheme, fmt)

    @staticmethod
    def _check_scheme(group_name: str, scheme, fmt: str | None) -> None:
        where = f"quantization_config.config_groups.{group_name}"
        weights, acts = scheme.weights, scheme.input_activations
        if fmt not in SUPPORTED_FORMATS:
            raise ValueError(
                f"{where}: format {fmt!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_FORMATS)})"
            )
        if weights is None:
            raise ValueError(f"{where}: activation-only quantization (no weights) is not supported")
        if _name(weights.type, "int") != "int":
            raise ValueError(
                f"{where}: {_name(weights.type, 'int')} weights (num_bits={weights.num_bits}) are "
                "not supported; "
                "float (FP8 / FP4) compressed-tensors schemes are not implemented")
        if weights.num_bits not in (4, 8):
            raise ValueError(f"{where}: {weights.num_bits}-bit weights are not supported (4 or 8)")
        strategy = _name(weights.strategy, "tensor")
        if strategy not in ("channel", "group", "tensor"):
            raise ValueError(
                f"{where}: weight strategy {strategy!r} is not supported (channel, group, tensor)")
        if weights.actorder is not None and _name(weights.actorder, "") == "group":
            raise ValueError(f"{where}: actorder='group' (weight_g_idx) is not supported")
        if scheme.output_activations is not None:
            raise ValueError(f"{where}: output activation quantization is not supported")
        if acts is not None:
            if weights.num_bits != 8 or acts.num_bits != 8 or _name(acts.type, "int") != "int":
                raise ValueError(
                    f"{where}: activations {_name(acts.type, 'int')}{acts.num_bits} with "
                    f"{weights.num_bits}-bit "
                    "weights are not supported (only int8 x int8, W8A8)")
            act_strategy = _name(acts.strategy, "tensor")
            if acts.dynamic is True and act_strategy != "token" \
                    or acts.dynamic is False and act_strategy != "tensor":
                raise ValueError(
                    f"{where}: activation strategy {act_strategy!r} with dynamic={acts.dynamic} is "
                    "not "
                    "supported (dynamic per-token, or static per-tensor)")
            if acts.dynamic is True and not acts.symmetric:
                raise ValueError(f"{where}: asymmetric dynamic activations are not supported")
            if not weights.symmetric:
                raise ValueError(f"{where}: W8A8 with asymmetric weights is not supported")
            if strategy == "group":
                raise ValueError(f"{where}: W8A8 with per-group weight scales is not supported")

    def _scheme_for(self, layer, prefix: str):
        from compressed_tensors.utils.match import is_match
        if is_match(prefix, layer, self.ignore):
            return None
        for group_name, (scheme, fmt) in self.groups.items():
            if is_match(prefix, layer, scheme.targets):
                return group_name, scheme, fmt
        return None

    def method_for(self, layer, prefix: str, tensors: TensorIndex) -> LinearMethod | None:
        found = self._scheme_for(layer, prefix)
        has = {
            suffix
            for suffix in ("weight", "weight_packed", "weight_scale", "weight_zero_point",
                           "weight_g_idx", "input_scale") if f"{prefix}.{suffix}" in tensors
        }
        if found is None or ("weight_scale" not in has and has <= {"weight"}):
            # Not targeted (or ignored), or stored dense although a broad target matched it: dense.
            # Dense means a float `weight` and nothing quantized next to it.
            if has - {"weight"}:
                raise ValueError(
                    f"{prefix}: the checkpoint holds quantization tensors "
                    f"{sorted(f'{prefix}.{s}' for s in has - {'weight'})} but quantization_config "
                    "does not quantize this layer (ignored or not targeted)")
            info = tensors.get(f"{prefix}.weight")
            if info is not None and info.dtype.startswith(("I", "U")):
                raise ValueError(
                    f"{prefix}.weight: integer tensor ({info.dtype}) on a layer "
                    "quantization_config "
                    "leaves dense")
            return None
        group_name, scheme, fmt = found
        weights, acts = scheme.weights, scheme.input_activations
        where = f"{prefix} (config group {group_name}, format {fmt})"
        strategy = _name(weights.strategy, "tensor")
        group_size = weights.group_size if strategy == "group" else None
        if "weight_g_idx" in has:
            raise ValueError(f"{prefix}.weight_g_idx: activation-ordered groups are not supported")
        packed = fmt == "pack-quantized"
        needed = {"weight_packed" if packed else "weight", "weight_scale"}
        if not weights.symmetric:
            needed.add("weight_zero_point")
        if acts is not None and acts.dynamic is False:
            needed.add("input_scale")
        missing = needed - has
        if missing:
            raise ValueError(f"{where}: missing tensors {sorted(f'{prefix}.{s}' for s in missing)}")
        if not packed:
            info = tensors[f"{prefix}.weight"]
            if info.dtype != "I8":
                raise ValueError(
                    f"{prefix}.weight: expected int8 for {fmt}, the checkpoint has {info.dtype}")
        if acts is None:
            return IntWeightMethod(weights.num_bits, group_size, weights.symmetric, packed,
                                   per_tensor=strategy == "tensor")
        if packed:
            raise ValueError(f"{where}: W8A8 must be int-quantized, not pack-quantized")
        return W8A8Method(dynamic=bool(acts.dynamic), input_symmetric=acts.symmetric,
                          per_tensor_weight=strategy == "tensor")
