"""Qwen3-Next (`Qwen3NextForCausalLM`): the Qwen3.5 text decoder (models/qwen3_5.py: Gated DeltaNet
and gated attention from `layer_types`) with a sparse mixture-of-experts block on the sparse
layers (transformers' rule: mlp_only_layers, decoder_sparse_step), routed experts plus a shared
expert scaled by its own sigmoid gate.

Its linear layers' projections come grouped by key head: `in_proj_qkvz` holds, per key head, its
q, k rows then the v and z rows of the value heads it serves; `in_proj_ba` per key head its b then
a rows. They are reordered on load into the [q | k | v | z] and [b | a] of the fused in_proj."""
from collections.abc import Iterable

import torch
from torch import nn

from vlinfer.layers import ModelContext, ReplicatedLinear
from vlinfer.layers.fused_moe import FusedMoE
from vlinfer.layers.linear import as_tensor
from vlinfer.loading import load_weights
from vlinfer.models.interfaces import Heads, OwnsWeightLoading
from vlinfer.models.llama import LlamaMLP, build_classifier, build_lm_head
from vlinfer.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5Model, build_mtp, mtp_weights
from vlinfer.models.qwen3_moe import check_experts_loaded, is_sparse_layer, route_expert_tensors


class SharedExpertMoE(FusedMoE):
    """The routed experts (FusedMoE: its router `gate` and `experts`) plus the shared expert,
    scaled per token by sigmoid(shared_expert_gate(x))."""

    def __init__(self, ctx: ModelContext, config):
        super().__init__(ctx, config.hidden_size, config.moe_intermediate_size,
                         config.num_experts, config.num_experts_per_tok,
                         # no norm_topk_prob in Qwen3.5-MoE configs: its router always renormalizes
                         bool(getattr(config, "norm_topk_prob", True)))
        shared = _Width(config, config.shared_expert_intermediate_size)
        self.shared_expert = LlamaMLP(ctx, shared)
        self.shared_expert_gate = ReplicatedLinear(ctx, config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class _Width:
    """The config as LlamaMLP reads it, with the shared expert's width."""

    def __init__(self, config, intermediate_size: int):
        self.hidden_size, self.intermediate_size = config.hidden_size, intermediate_size
        self.hidden_act, self.mlp_bias = config.hidden_act, False


def grouped_rows(tensor: torch.Tensor, groups: int, sizes: list[int]) -> list[torch.Tensor]:
    """Rows laid out per group as [part 0 | part 1 | ...] -> each part's rows over the groups."""
    parts = tensor.reshape(groups, sum(sizes), -1).split(sizes, 1)
    return [p.reshape(-1, tensor.shape[-1]) for p in parts]


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM, OwnsWeightLoading):
    def __init__(self, config, ctx: ModelContext, heads: Heads = Heads()):
        nn.Module.__init__(self)
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported activation hidden_act={config.hidden_act!r} in the "
                             "checkpoint's config; the experts run 'silu' (SwiGLU) only")
        self.config = config

        def make_mlp(i: int):
            return SharedExpertMoE(ctx, config) if is_sparse_layer(config, i) else None
        self.model = Qwen3_5Model(ctx, config, make_mlp)
        self.lm_head = build_lm_head(ctx, config, self.model.embed_tokens,
                                     config.tie_word_embeddings, heads)
        # the MTP layer is layer 0 of its own stack: sparse by the same rule (vLLM's)
        self.mtp = build_mtp(ctx, config, heads, make_mlp(0) if heads.mtp else None)
        self.classifier = build_classifier(ctx, config, heads)  # registered last: loaded last

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, route_expert_tensors(self, self._reordered(mtp_weights(self, weights))))
        check_experts_loaded(self)

    def _reordered(self, weights):
        c = self.config
        nk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
        per_group = c.linear_num_value_heads // nk
        for name, tensor in weights:
            if name.endswith(".in_proj_qkvz.weight"):
                q, k, v, z = grouped_rows(as_tensor(tensor), nk,
                                          [dk, dk, per_group * dv, per_group * dv])
                prefix = name.removesuffix("in_proj_qkvz.weight")
                yield prefix + "in_proj_qkv.weight", torch.cat([q, k, v])
                yield prefix + "in_proj_z.weight", z
            elif name.endswith(".in_proj_ba.weight"):
                b, a = grouped_rows(as_tensor(tensor), nk, [per_group, per_group])
                prefix = name.removesuffix("in_proj_ba.weight")
                yield prefix + "in_proj_b.weight", b
                yield prefix + "in_proj_a.weight", a
            else:
                yield name, tensor
