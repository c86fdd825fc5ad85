"""Qwen3.5 with vision (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`):
Qwen3-VL's vision tower without DeepStack (models/qwen3_vl_vision.py, no deepstack mergers) and
the Qwen3.5 hybrid decoder (models/qwen3_5.py) with interleaved multimodal rotary over the
rotary part of each head (partial_rotary_factor). Placeholders, the processor, M-RoPE positions,
the checkpoint layout (`model.visual.*`, `model.language_model.*`, `lm_head.*`) and the prefill
contract are Qwen3-VL's (models/qwen3_vl.py); the linear layers' state lives in the cache pool's
per-sequence slots (HasStateSlots)."""
from collections.abc import Iterable

import torch
from torch import nn

from vlinfer.layers import ModelContext
from vlinfer.layers.linear_attention import GatedDeltaNet
from vlinfer.models.interfaces import Heads, HasStateSlots
from vlinfer.models.llama import build_classifier, build_lm_head
from vlinfer.models.qwen3_5 import (Qwen3_5ForCausalLM, Qwen3_5Model, Qwen3_5MTPRunner,
                                    build_mtp, mtp_weights)
from vlinfer.models.qwen3_5_moe import check_silu
from vlinfer.models.qwen3_moe import check_experts_loaded, route_expert_tensors
from vlinfer.models.qwen3_next import SharedExpertMoE
from vlinfer.models.qwen3_vl import (MRotaryEmbedding, Qwen3VLForConditionalGeneration,
                                     holds_tower)


class Qwen3_5VLModel(nn.Module):
    """`model.visual` (rank 0 only, none under language_model_only, as Qwen3-VL's) and
    `model.language_model`."""

    def __init__(self, ctx: ModelContext, config, make_mlp=None, vision_tower: bool = True):
        super().__init__()
        self.visual = holds_tower(ctx, config, vision_tower)
        text = config.text_config
        self.language_model = Qwen3_5Model(ctx, text, make_mlp, MRotaryEmbedding(text))


class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration, HasStateSlots,
                                      Qwen3_5MTPRunner):
    packed_modules_mapping = Qwen3_5ForCausalLM.packed_modules_mapping

    def __init__(self, config, ctx: ModelContext, heads: Heads = Heads()):
        nn.Module.__init__(self)
        self.config = config
        text = config.text_config
        self.model = Qwen3_5VLModel(ctx, config, self.text_mlp_factory(ctx, text),
                                    heads.vision_tower)
        tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = build_lm_head(ctx, text, self.model.language_model.embed_tokens, tied, heads)
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.num_deepstack = 0
        mlp = self.text_mlp_factory(ctx, text)
        self.mtp = build_mtp(ctx, text, heads, mlp(0) if mlp is not None and heads.mtp else None)
        self.classifier = build_classifier(ctx, text, heads)  # registered last: loaded last

    def state_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.modules() if isinstance(m, GatedDeltaNet)]

    def mtp_language_model(self) -> Qwen3_5Model:
        return self.model.language_model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(mtp_weights(self, weights))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mm_embeds: torch.Tensor | None = None, mm_mask: torch.Tensor | None = None,
                deepstack_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As Qwen3-VL's; deepstack_embeds (empty: no DeepStack) is ignored."""
        lm = self.model.language_model
        hidden_states = lm.embed_tokens(input_ids)
        if mm_mask is not None and mm_embeds is not None:
            hidden_states[mm_mask] = mm_embeds.to(hidden_states.dtype)
        return lm(input_ids, positions, hidden_states)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    def text_mlp_factory(self, ctx: ModelContext, text_config):
        check_silu(text_config)
        return lambda i: SharedExpertMoE(ctx, text_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(route_expert_tensors(self, mtp_weights(self, weights)))
        check_experts_loaded(self)
