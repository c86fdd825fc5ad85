"""Qwen3-VL (dense): our vision tower + the Qwen3 decoder (qk-norm) with interleaved multimodal
rotary and DeepStack.

Module names mirror transformers' checkpoint layout (`model.visual.*`, `model.language_model.*`,
`lm_head.*`), so checkpoint tensors map onto parameters by name, with q/k/v and gate/up fused as in
Llama.

The prefill contract: the caller encodes images once with `encode_images`, then for each chunk
passes the rows of image embeddings (and of each DeepStack level) that fall inside that chunk, in
token order, plus a bool mask of which chunk tokens are image placeholders. Positions are MRoPE
positions [3, T].
"""
from collections.abc import Iterable

import torch
from torch import nn

from vlinfer.layers import ModelContext, rope_inv_freq
from vlinfer.layers.linear import as_tensor
from vlinfer.layers.rotary import mrope_cos_sin
from vlinfer.loading import load_weights
from vlinfer.models.interfaces import (Heads, HasMTPHead, OwnsWeightLoading, SupportsMRoPE,
                                       SupportsMultiModal, SupportsPooling)
from vlinfer.models.llama import LlamaForCausalLM, LlamaModel, build_classifier, build_lm_head
from vlinfer.models.qwen3_vl_vision import Qwen3VLVisionModel, split_image_embeds


class MRotaryEmbedding(nn.Module):
    """Interleaved MRoPE cos/sin for positions [3, T] (or [T] for text-only steps), computed once
    per forward and shared by every decoder layer."""

    def __init__(self, config):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config)
        # A plain attribute, not a buffer: Module.to(bfloat16) would round the frequencies, while HF
        # keeps inv_freq float32 for bf16 checkpoints (a rounded inv_freq visibly shifts
        # large-position angles). Moved lazily.
        self.inv_freq = inv_freq.float()
        # Same default as HF's Qwen3VLTextRotaryEmbedding.
        self.mrope_section = tuple(
            int(s) for s in config.rope_parameters.get("mrope_section", [24, 20, 20]))

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        # Rounded to the activation dtype, as HF casts them (cos.to(x.dtype)) before rotating, then
        # held in float32: every rotary implementation rotates in float32, and converting once here
        # saves a copy per layer.
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.mrope_section,
                                 self.attention_scaling, dtype)
        return cos.float(), sin.float()


class Qwen3VLTextModel(LlamaModel):
    """The Qwen3 decoder (qk_norm) with interleaved multimodal rotary and DeepStack injection after
    early layers."""

    def __init__(self, ctx: ModelContext, config, make_mlp=None):
        super().__init__(ctx, config, qk_norm=True, rotary_emb=MRotaryEmbedding(config),
                         make_mlp=make_mlp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None, visual_mask: torch.Tensor | None = None,
                deepstack_embeds=None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        num_deepstack = 0 if deepstack_embeds is None or visual_mask is None else len(
            deepstack_embeds)
        rope = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        # text-only steps (every decode step): the shared decoder loop, fused where it can be
        if not num_deepstack:
            hidden_states, residual = self.run_layers(rope, hidden_states)
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                hidden_states, residual = layer(rope, hidden_states, residual)
                if i < num_deepstack:
                    # HF adds DeepStack features to the layer's output, i.e. the full residual
                    # stream. Ours is split as (mlp_out, residual); materialize the sum so rounding
                    # matches HF's (res + mlp) + ds, and let the next layer start un-fused (residual
                    # None). The add would happen in the next layer's fused add-norm anyway, so this
                    # costs only the masked update.
                    hidden_states = hidden_states + residual
                    deepstack = deepstack_embeds[i].to(hidden_states.dtype)
                    hidden_states[visual_mask] = hidden_states[visual_mask] + deepstack
                    residual = None
        if residual is None:
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3VLModel(nn.Module):
    """Holds the two towers under HF's `model.` prefix: `model.visual`, `model.language_model`.

    Under tensor parallelism the language model is sharded and the vision tower lives on rank 0
    only: rank 0 encodes each image once (encoder cache) and sends the rows of image embeddings and
    DeepStack features a step needs with that step's inputs (vlinfer/engine/model_runner.py), so the
    other ranks neither build nor read it."""

    def __init__(self, ctx: ModelContext, config, make_mlp=None, vision_tower: bool = True):
        super().__init__()
        self.visual = holds_tower(ctx, config, vision_tower)
        self.language_model = Qwen3VLTextModel(ctx, config.text_config, make_mlp)


def holds_tower(ctx: ModelContext, config, vision_tower: bool) -> Qwen3VLVisionModel | None:
    """The vision tower on tensor-parallel rank 0 (the others never run it); None on the other
    ranks and for a language-model-only build (Heads.vision_tower False)."""
    if ctx.tp.rank != 0 or not vision_tower:
        return None
    return Qwen3VLVisionModel(config.vision_config, ctx)


class _TextWeights(nn.Module):
    """A view over the text half (language model + LM head) for vlinfer.loading.load_weights: it
    checks that every parameter it sees is loaded, and the vision tower is loaded separately."""

    def __init__(self, owner: "Qwen3VLForConditionalGeneration"):
        super().__init__()
        self.config = owner.config  # top-level tie_word_embeddings is the one HF honours
        self.packed_modules_mapping = owner.packed_modules_mapping
        self.language_model = owner.model.language_model
        self.lm_head = owner.lm_head
        if isinstance(owner, HasMTPHead) and owner.mtp is not None:  # Qwen3.5's (mtp.*)
            self.mtp = owner.mtp


class Qwen3VLForConditionalGeneration(nn.Module, SupportsMultiModal, SupportsMRoPE, SupportsPooling,
                                      OwnsWeightLoading):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config, ctx: ModelContext, heads: Heads = Heads()):
        super().__init__()
        self.config = config
        text = config.text_config
        self.model = Qwen3VLModel(ctx, config, self.text_mlp_factory(ctx, text),
                                  heads.vision_tower)
        tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = build_lm_head(ctx, text, self.model.language_model.embed_tokens, tied, heads)
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.num_deepstack = len(config.vision_config.deepstack_visual_indexes)
        self.classifier = build_classifier(ctx, text, heads)  # registered last: loaded last

    @property
    def holds_vision_tower(self) -> bool:
        return self.model.visual is not None

    def text_mlp_factory(self, ctx: ModelContext, text_config):
        """make_mlp(layer_index) for the decoder's layers (the MoE variant's sparse blocks); None:
        dense MLPs."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load an HF Qwen3-VL checkpoint stream: `model.visual.*` goes to the vision tower, the
        rest (names `model.language_model.*`, `lm_head.weight`) through loading.load_weights with
        the fused mappings."""
        visual = self.model.visual
        visual_loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                if name.startswith("model.visual."):  # streamed straight in, nothing buffered
                    if visual is not None:  # ranks other than 0, language_model_only: unread
                        visual_loaded.update(
                            visual.load_weights([(name[len("model.visual."):], as_tensor(tensor))]))
                else:
                    yield name, tensor

        load_weights(_TextWeights(self), text_weights(),
                                  prefix_map={"model.language_model.": "language_model."})
        missing = [
            n for n, _ in (visual.named_parameters() if visual is not None else [])
            if n not in visual_loaded
        ]
        if missing:
            raise ValueError(f"checkpoint is missing vision weights for {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor,
                      grid_thw) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One packed vision pass over all images. pixel_values [N_patches, C*T*P*P] in processor
        order, grid_thw [num_images, 3]. Returns per image (embeds [n_tokens, hidden], deepstack
        [num_deepstack, n_tokens, hidden]), n_tokens = t*h*w / merge^2 = the image's placeholder
        count."""
        visual = self.model.visual
        if visual is None:
            raise RuntimeError("images are encoded on tensor-parallel rank 0 only")
        embeds, deepstack = visual(pixel_values.to(visual.device), grid_thw)
        if deepstack:
            stacked = torch.stack(deepstack)
        else:
            stacked = embeds.new_zeros(0, *embeds.shape)
        per_image = split_image_embeds(embeds, grid_thw, self.spatial_merge_size)
        sizes = [e.shape[0] for e in per_image]
        return list(zip(per_image, torch.split(stacked, sizes, dim=1)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mm_embeds: torch.Tensor | None = None, mm_mask: torch.Tensor | None = None,
                deepstack_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], positions [3, T] (a text-only [T] also works). mm_mask bool [T] marks
        image placeholder rows; mm_embeds [mm_mask.sum(), hidden] replaces them in order;
        deepstack_embeds [num_deepstack, mm_mask.sum(), hidden] is added to those rows after decoder
        layers 0..num_deepstack-1. Returns hidden states [T, hidden] (final norm applied)."""
        lm = self.model.language_model
        hidden_states = lm.embed_tokens(input_ids)
        if mm_mask is None:
            return lm(input_ids, positions, hidden_states)
        if mm_embeds is not None:
            hidden_states[mm_mask] = mm_embeds.to(hidden_states.dtype)
        return lm(input_ids, positions, hidden_states, mm_mask, deepstack_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
