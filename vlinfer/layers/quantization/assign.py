"""Gives every linear layer of a built model its quantization method, before any weight is read: the
checkpoint format (a CheckpointQuantization) is asked once per checkpoint shard of each layer
(q_proj, k_proj and v_proj for the fused qkv_proj), the shards must agree, and the layer then
declares the parameters its method loads."""
import logging
from collections import Counter

from torch import nn

from vlinfer.layers.fused_moe import FusedMoE
from vlinfer.layers.linear import LinearBase
from vlinfer.layers.quantization.base import CheckpointQuantization, TensorIndex

logger = logging.getLogger("vlinfer")


def shard_prefixes(module_name: str, packed_modules_mapping: dict) -> list[str]:
    """Checkpoint module names of a layer: its own name, or for a fused layer each shard's, in shard
    order."""
    parent, _, leaf = module_name.rpartition(".")
    shards = [(shard_id, fragment)
              for fragment, (fused, shard_id) in packed_modules_mapping.items() if fused == leaf]
    if not shards:
        return [module_name]
    order = {"q": 0, "k": 1, "v": 2}
    shards.sort(
        key=lambda item: order.get(item[0], item[0]) if isinstance(item[0], str) else item[0])
    return [f"{parent}.{fragment}" if parent else fragment for _, fragment in shards]


def assign_methods(model: nn.Module, quantization: CheckpointQuantization,
                   tensors: TensorIndex) -> Counter:
    """Set each LinearBase's method from `quantization`; returns how many layers got each (for the
    load log). Raises ValueError naming the layer when its fused shards would need different
    methods."""
    packed = getattr(model, "packed_modules_mapping", {})
    counts = Counter()
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        prefixes = shard_prefixes(name, packed)
        methods = [quantization.method_for(layer, prefix, tensors) for prefix in prefixes]
        signatures = [None if m is None else m.signature() for m in methods]
        quantized = [m for m in methods if m is not None]
        if len(set(signatures) - {None}) == 1 and quantized[0].hosts_dense_shards:
            # e.g. Qwen's FP8 Gated DeltaNet: in_proj_qkv / z FP8, in_proj_b / a dense by name
            methods = [quantized[0]] * len(methods)
        elif len(set(signatures)) > 1:
            found = ", ".join(f"{p}: {'dense' if m is None else m.describe()}"
                              for p, m in zip(prefixes, methods))
            raise ValueError(
                f"layer {name}: its fused shards are quantized differently ({found}); they run as "
                "one "
                "matmul and must share one scheme")
        method = methods[0]
        if method is not None:
            layer.set_method(method)
        counts["dense" if method is None else method.describe()] += 1
    summary = ", ".join(f"{n} {what}" for what, n in counts.most_common())
    logger.info("quantization (%s): linear layers %s", quantization.describe(), summary)
    moe_layers = [(name, layer) for name, layer in model.named_modules()
                  if isinstance(layer, FusedMoE)]
    for name, layer in moe_layers:
        layer.set_checkpoint_quantization(quantization, tensors, name)
    quantized_experts = sum(1 for name in tensors
                            if ".experts." in name and name.endswith(QUANTIZED_SUFFIXES))
    if moe_layers and quantized_experts:
        logger.warning(
            "quantization (%s): the MoE experts' %d quantized projections are dequantized on load "
            "to the "
            "compute dtype and run dense (no kept-quantized expert kernels yet): they open and "
            "match, but "
            "take dense memory", quantization.describe(), quantized_experts)
    refuse_quantized_dense_parts(model, tensors)
    return counts


# A checkpoint tensor with one of these suffixes carries a quantized projection's scales.
QUANTIZED_SUFFIXES = (".weight_scale", ".weight_scale_inv")
# ... or its packed values / zero points / activation scales (compressed-tensors, FP8, GPTQ names)
QUANTIZED_PART_SUFFIXES = (*QUANTIZED_SUFFIXES, ".weight_packed", ".weight_zero_point",
                           ".input_scale", ".qweight", ".qzeros", ".scales", ".g_idx")


def refuse_quantized_dense_parts(model: nn.Module, tensors: TensorIndex) -> None:
    """A checkpoint that quantizes a module vlinfer keeps dense (a norm, an embedding, Gated
    DeltaNet's conv1d or its gated norm: anything but a linear layer or an MoE layer's experts) is
    refused naming the tensor, rather than its scales failing as unknown names or its values
    loading unscaled."""
    modules = dict(model.named_modules())
    for name in tensors:
        if not name.endswith(QUANTIZED_PART_SUFFIXES):
            continue
        module_name = name.rsplit(".", 1)[0]
        module = modules.get(module_name)
        if module is None or isinstance(module, (LinearBase, FusedMoE)) or any(
                isinstance(modules.get(module_name[:i]), FusedMoE)
                for i in range(len(module_name)) if module_name[i] == "."):
            continue
        raise ValueError(
            f"checkpoint tensor {name!r}: the checkpoint quantizes {module_name} (a "
            f"{type(module).__name__}), which vlinfer keeps dense: only linear layers and MoE "
            "experts hold quantized weights")
