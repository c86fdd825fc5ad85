"""What a model class can do, declared on the class (vLLM's SupportsMultiModal and friends).

The engine reads these declarations with isinstance; it never probes a built model with
hasattr / getattr and never sets attributes on one. A model's heads are chosen when it is built
(`Heads`, the third constructor argument): the LM head where the checkpoint has one, a
classifier's rows for a reranker. Everything else a class declares by inheriting:

- `SupportsMultiModal`: a vision tower; `encode_images` turns packed images into their rows.
- `SupportsMRoPE`: positions are three rows (temporal, height, width), [3, T], not [T].
- `SupportsPooling`: `pool` turns pooled rows' hidden states into a pooling request's output.
- `OwnsWeightLoading`: `load_weights` routes its own checkpoint stream (two towers, MoE experts).
- `SupportsFusedDecode` (a decoder): `fuse_decode` runs decode steps' layers in one op call.
- `PrefillOnly` (a part): it never runs a decode step's few rows (vision towers), so its linears
  keep the layout that suits large row counts.
- `PagedAttentionBlock` (an attention module): its `qkv_proj` and `attn` (layers.Attention) keep
  K and V in the paged KV cache; a checkpoint's KV scales attach to these, in layer order.

- `HasStateSlots` (a hybrid model: linear-attention layers beside full attention, docs
  hybrid.md): `state_layers` names the layers that keep a fixed-size state per sequence and the
  shapes of one slot, for the cache pool's state slots (engine/cache_pool.py).
- `HasMTPHead`: the checkpoint may carry a multi-token prediction head (Qwen3.5, Qwen3-Next:
  `mtp.*`), built as `mtp` under Heads(mtp=True) (None otherwise); `mtp_embeds` and `mtp_forward`
  run it (engine/mtp_head.py, docs/speculative.md "MTP")."""
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Heads:
    """The heads (and towers) a model is built with. lm_head=False: an embedder saved without one
    (nothing to generate with). classifier_token_ids: a reranker's label tokens, whose LM head rows
    are its classifier (layers/pooler.py)."""
    lm_head: bool = True
    classifier_token_ids: tuple[int, ...] | None = None
    # False: a vision-language model built as its language model alone (language_model_only): no
    # vision tower, its checkpoint tensors skipped unread.
    vision_tower: bool = True
    # True: the checkpoint's MTP head is built and loaded (speculative_config method "mtp"); False:
    # its tensors are skipped unread.
    mtp: bool = False


class SupportsMultiModal:
    holds_vision_tower: bool  # this tensor-parallel rank holds the tower (rank 0 alone does)

    def encode_images(self, pixel_values: torch.Tensor,
                      grid_thw) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One packed vision pass: per image (embeds [n, hidden], deepstack [k, n, hidden])."""
        raise NotImplementedError


class SupportsMRoPE:
    pass


class SupportsPooling:
    def pool(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A pooling request's output from its pooled rows' hidden states: a classifier's label
        logits where the model was built with one (no vocabulary matmul), else the rows."""
        classifier = self.classifier
        return classifier(hidden_states) if classifier is not None else hidden_states


class OwnsWeightLoading:
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError


class SupportsFusedDecode:
    def fuse_decode(self) -> bool:
        """Fuse the layers for decode steps once after packing; False where they cannot be."""
        raise NotImplementedError


class PrefillOnly:
    pass


class PagedAttentionBlock:
    pass


class HasStateSlots:
    def state_layers(self) -> list:
        """The layers whose state lives in per-sequence slots, in layer order, all alike: each has
        `state_shapes` (one slot's tensors, e.g. the conv state and the recurrent state) and
        `state_dtypes` (the dtype each is stored in), and gets
        `states`, views [num_slots, *shape] of the cache pool, bound when the pool is allocated
        (layers/linear_attention.py GatedDeltaNet)."""
        raise NotImplementedError


class HasMTPHead:
    mtp: torch.nn.Module | None

    def mtp_embeds(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                   mm_mask: torch.Tensor | None = None, **_) -> torch.Tensor:
        """The input rows the target's forward saw for these tokens (image rows spliced in)."""
        raise NotImplementedError

    def mtp_forward(self, embeds: torch.Tensor, hidden_states: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        """The MTP head at rotary `positions`: embeds of the next tokens and the hidden states
        before them -> its output rows, which the LM head (compute_logits) reads."""
        raise NotImplementedError
