"""Qwen3.5-MoE text (`Qwen3_5MoeForCausalLM`, model_type qwen3_5_moe_text): the Qwen3.5 hybrid
decoder (models/qwen3_5.py) with a sparse mixture-of-experts block on every layer, routed experts
plus a shared expert scaled by its own sigmoid gate (models/qwen3_next.py SharedExpertMoE). Its
router always renormalizes the top-k weights; its linear layers' projections come split as in
Qwen3.5 (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
from collections.abc import Iterable

import torch
from torch import nn

from vlinfer.layers import ModelContext
from vlinfer.loading import load_weights
from vlinfer.models.interfaces import Heads, OwnsWeightLoading
from vlinfer.models.llama import build_classifier, build_lm_head
from vlinfer.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5Model, build_mtp, mtp_weights
from vlinfer.models.qwen3_moe import check_experts_loaded, route_expert_tensors
from vlinfer.models.qwen3_next import SharedExpertMoE


def check_silu(config) -> None:
    if config.hidden_act != "silu":
        raise ValueError(f"unsupported activation hidden_act={config.hidden_act!r} in the "
                         "checkpoint's config; the experts run 'silu' (SwiGLU) only")


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM, OwnsWeightLoading):
    def __init__(self, config, ctx: ModelContext, heads: Heads = Heads()):
        nn.Module.__init__(self)
        check_silu(config)
        self.config = config
        self.model = Qwen3_5Model(ctx, config, lambda i: SharedExpertMoE(ctx, config))
        self.lm_head = build_lm_head(ctx, config, self.model.embed_tokens,
                                     config.tie_word_embeddings, heads)
        self.mtp = build_mtp(ctx, config, heads,
                             SharedExpertMoE(ctx, config) if heads.mtp else None)
        self.classifier = build_classifier(ctx, config, heads)  # registered last: loaded last

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, route_expert_tensors(self, mtp_weights(self, weights)))
        check_experts_loaded(self)
