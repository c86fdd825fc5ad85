"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): the dense Qwen3-VL (same vision tower,
MRoPE, DeepStack) with Qwen3-MoE's sparse blocks in the decoder. Its router renormalizes the top-k
weights always: transformers' Qwen3VLMoeTextTopKRouter has no norm_topk_prob switch. The hub
checkpoints store each layer's experts as fused 3-D tensors in a transposed layout, transformers'
save_pretrained in its in-memory one; qwen3_moe.route_expert_tensors tells them apart by shape."""
from collections.abc import Iterable

import torch

from vlinfer.layers import ModelContext
from vlinfer.models.qwen3_moe import check_experts_loaded, moe_mlp_factory, route_expert_tensors
from vlinfer.models.qwen3_vl import Qwen3VLForConditionalGeneration


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    def text_mlp_factory(self, ctx: ModelContext, text_config):
        return moe_mlp_factory(ctx, text_config, renormalize=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(route_expert_tensors(self, weights))
        check_experts_loaded(self)
