"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (qk-norm) with a sparse
mixture-of-experts block in place of the MLP in every layer the config makes sparse
(vlinfer/layers/fused_moe.py), a dense MLP in the others.

Expert tensors come in three checkpoint layouts, told apart by name and then by shape: one tensor
per expert (`...mlp.experts.E.{gate,up,down}_proj.weight`, the Qwen3-MoE hub and what transformers'
save_pretrained writes for it), or one fused 3-D tensor per layer
(`...mlp.experts.{gate_up,down}_proj`) in transformers' in-memory layout or the Qwen3-VL-MoE hub's
transposed one. They load straight into the fused layout of the MoE op, this rank's part only; every
other tensor goes through loading.load_weights as in the dense models."""
import re
from collections.abc import Iterable

import torch
from torch import nn

from vlinfer.loading import load_weights
from vlinfer.layers import ModelContext
from vlinfer.layers.fused_moe import FusedMoE
from vlinfer.models.interfaces import Heads, OwnsWeightLoading, SupportsPooling
from vlinfer.models.llama import LlamaForCausalLM, LlamaModel, build_classifier, build_lm_head

# One expert's projection tensor (`weight`, or a quantized projection's `weight_packed`,
# `weight_scale`, ...), or a layer's fused 3-D tensor.
EXPERT_TENSOR = re.compile(
    r"^(?P<layer>.+\.mlp)\.experts\.(?:(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\."
    r"(?P<suffix>weight\w*|input_scale|input_zero_point)|(?P<fused>gate_up|down)_proj)$")


def is_sparse_layer(config, layer_index: int) -> bool:
    """transformers' rule: sparse unless listed in mlp_only_layers, when there are experts and the
    layer falls on the decoder_sparse_step."""
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or []) and
            config.num_experts > 0 and (layer_index + 1) % config.decoder_sparse_step == 0)


def moe_mlp_factory(ctx: ModelContext, config, renormalize: bool):
    """make_mlp(layer_index) for LlamaModel: a FusedMoE on sparse layers, None (the dense MLP) on
    the others."""
    if config.hidden_act != "silu":
        raise ValueError(
            f"unsupported activation hidden_act={config.hidden_act!r} in the checkpoint's config; "
            "the "
            "MoE experts run 'silu' (SwiGLU) only")

    def make_mlp(layer_index: int):
        if not is_sparse_layer(config, layer_index):
            return None
        return FusedMoE(ctx, config.hidden_size, config.moe_intermediate_size, config.num_experts,
                        config.num_experts_per_tok, renormalize)
    return make_mlp


def route_expert_tensors(model: nn.Module, weights: Iterable):
    """Loads the expert tensors of the stream into model's FusedMoE layers (found by their module
    names, which mirror the checkpoint's) and yields every other tensor, for loading.load_weights.
    """
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    for name, tensor in weights:
        match = EXPERT_TENSOR.match(name)
        if match is None:
            yield name, tensor
            continue
        layer = layers.get(match["layer"])
        if layer is None:
            raise ValueError(
                f"checkpoint tensor {name!r}: expert weights for a layer that is not a sparse MoE "
                "layer "
                "in this config (see mlp_only_layers / decoder_sparse_step / num_hidden_layers)")
        try:
            if match["fused"]:
                layer.load_fused(match["fused"], tensor)
            else:
                layer.load_expert_tensor(int(match["expert"]), match["proj"], match["suffix"],
                                         tensor)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def check_experts_loaded(model: nn.Module) -> None:
    for name, layer in model.named_modules():
        if isinstance(layer, FusedMoE):
            missing = layer.missing_experts()
            if missing:
                raise ValueError(
                    f"checkpoint is missing expert weights of {name}: {', '.join(missing[:8])}"
                    f"{' ...' if len(missing) > 8 else ''}")


class Qwen3MoeForCausalLM(nn.Module, SupportsPooling, OwnsWeightLoading):
    # attention and the dense layers' MLPs
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config, ctx: ModelContext, heads: Heads = Heads()):
        super().__init__()
        self.config = config
        # transformers' Qwen3MoeTopKRouter renormalizes the top-k weights only when norm_topk_prob
        # is set.
        make_mlp = moe_mlp_factory(ctx, config, renormalize=bool(config.norm_topk_prob))
        self.model = LlamaModel(ctx, config, qk_norm=True, make_mlp=make_mlp)
        self.lm_head = build_lm_head(ctx, config, self.model.embed_tokens,
                                     config.tie_word_embeddings, heads)
        self.classifier = build_classifier(ctx, config, heads)  # registered last: loaded last

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, route_expert_tensors(self, weights))
        check_experts_loaded(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
