"""Qwen3.5 text (`Qwen3_5ForCausalLM`, model_type qwen3_5_text): a hybrid decoder whose layers are
Gated DeltaNet (linear attention, layers/linear_attention.py) or gated full attention, one per
`layer_types` entry, each followed by the dense SwiGLU MLP. The full-attention layers' q_proj is
twice the query width (per head: the query, then its output gate), q and k get RMSNorm, rotary
turns the first partial_rotary_factor of each head, and the output is multiplied by
sigmoid(gate) before o_proj; their K and V live in the paged KV cache. The linear layers' state
lives in the cache pool's per-sequence slots (HasStateSlots). Norms scale by 1 + weight
(layers/layernorm.py OffsetRMSNorm).

Text-only positions: Qwen3.5's interleaved M-RoPE with all three rows equal to the token index
(what transformers uses for text) gives the plain rotary of that index, so positions are [T].

The checkpoint's multi-token prediction head (`mtp.*`, transformers drops it; `Qwen3_5MTP` below)
is built only for speculative_config method "mtp" (Heads.mtp); otherwise its tensors are skipped
unread."""
import logging
from collections.abc import Iterable

import torch
from torch import nn

from vlinfer.layers import (Attention, ModelContext, QKVParallelLinear, ReplicatedLinear,
                            RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding)
from vlinfer.layers.layernorm import OffsetRMSNorm
from vlinfer.layers.linear_attention import GatedDeltaNet
from vlinfer.loading import load_weights
from vlinfer.models.interfaces import (Heads, HasMTPHead, HasStateSlots, OwnsWeightLoading,
                                       SupportsPooling)
from vlinfer.models.llama import LlamaForCausalLM, LlamaMLP, build_classifier, build_lm_head

logger = logging.getLogger("vlinfer")
LAYER_TYPES = ("linear_attention", "full_attention")
MTP_PREFIX = "mtp."


def check_layer_types(config) -> list[str]:
    """The config's layer_types, one known entry per decoder layer, or a clear error naming the
    field."""
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != config.num_hidden_layers:
        got = len(layer_types) if isinstance(layer_types, (list, tuple)) else repr(layer_types)
        raise ValueError(f"the checkpoint's layer_types has {got} entries, num_hidden_layers="
                         f"{config.num_hidden_layers}: one entry per decoder layer is needed")
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"the checkpoint's layer_types has unknown entries {unknown}; "
                         f"vlinfer runs {list(LAYER_TYPES)}")
    if "full_attention" not in layer_types:  # the cache pool takes one paged KV group
        raise ValueError("the checkpoint's layer_types has no full_attention entry: vlinfer runs "
                         "hybrid models with at least one full-attention layer")
    return list(layer_types)


class Qwen3_5Attention(nn.Module):
    def __init__(self, ctx: ModelContext, config):
        super().__init__()
        self.ops = ctx.ops
        self.head_dim = getattr(config, "head_dim",
                                None) or config.hidden_size // config.num_attention_heads
        bias = getattr(config, "attention_bias", False)
        # q_proj's 2 * heads "heads" of head_dim: each query head followed by its gate
        self.qkv_proj = QKVParallelLinear(ctx, config.hidden_size, self.head_dim,
                                          2 * config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(ctx, config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=bias)
        self.attn = Attention(ctx, self.num_heads, self.head_dim, self.head_dim**-0.5,
                              self.num_kv_heads)
        self.q_norm = OffsetRMSNorm(ctx, self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(ctx, self.head_dim, config.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor],
                hidden_states: torch.Tensor) -> torch.Tensor:
        n, d = len(hidden_states), self.head_dim
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        qg, k, v = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], -1)
        q, gate = qg.view(n, self.num_heads, 2 * d).split([d, d], -1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(n, self.num_kv_heads, d))
        v = v.reshape(n, self.num_kv_heads, d)
        cos, sin = rope  # [T, rotary_dim]: partial rotary turns the head's first rotary_dim
        rd = cos.shape[-1]
        q_rot, k_rot = self.ops.apply_rotary(q[..., :rd].contiguous(), k[..., :rd].contiguous(),
                                             cos, sin)
        q = torch.cat([q_rot, q[..., rd:]], -1)
        k = torch.cat([k_rot, k[..., rd:]], -1)
        o = self.attn(q, k, v) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(o)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, config, layer_type: str, mlp: nn.Module | None = None):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(ctx, config)
        else:
            self.self_attn = Qwen3_5Attention(ctx, config)
        self.mlp = mlp if mlp is not None else LlamaMLP(ctx, config)  # MoE models pass theirs
        self.input_layernorm = OffsetRMSNorm(ctx, config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(ctx, config.hidden_size,
                                                      config.rms_norm_eps)

    def forward(self, rope, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.layer_type == "linear_attention":
            hidden_states = self.linear_attn(hidden_states)
        else:
            hidden_states = self.self_attn(rope, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3_5Model(nn.Module):
    def __init__(self, ctx: ModelContext, config, make_mlp=None, rotary_emb: nn.Module = None):
        """make_mlp(layer_index) -> the layer's MLP (MoE models), or None: the dense one;
        rotary_emb: the vision models' multimodal one (cos_sin of [3, T] positions)."""
        super().__init__()
        layer_types = check_layer_types(config)
        self.embed_tokens = VocabParallelEmbedding(ctx, config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([
            Qwen3_5DecoderLayer(ctx, config, layer_type, make_mlp(i) if make_mlp else None)
            for i, layer_type in enumerate(layer_types)])
        self.norm = OffsetRMSNorm(ctx, config.hidden_size, config.rms_norm_eps)
        # rope_inv_freq reads partial_rotary_factor: the table spans the rotary part only
        self.rotary_emb = rotary_emb or RotaryEmbedding(config, config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(rope, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3_5MTP(nn.Module):
    """The multi-token prediction head: at position p it takes the target's final hidden state h_p
    (after the target's final norm: what the LM head reads) and the input row of token p + 1 (an
    image row where that token is a placeholder),
        y = norm(layer(fc(cat(pre_fc_norm_embedding(row), pre_fc_norm_hidden(h_p))), rotary p))
    and the target's LM head on y gives the logits of token p + 2. `layers.0` is a full-attention
    decoder layer (its MLP `mlp`: the MoE block on MoE models) whose K and V live in the target's
    paged KV pool at position p's slot. k > 1 proposals feed its own output y back as the next
    hidden state (vLLM's MTP proposer). The embedding and the LM head are the target's."""
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, ctx: ModelContext, config, mlp: nn.Module | None = None):
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = ReplicatedLinear(ctx, 2 * h, h)
        self.pre_fc_norm_embedding = OffsetRMSNorm(ctx, h, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(ctx, h, eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(ctx, config, "full_attention", mlp)])
        self.norm = OffsetRMSNorm(ctx, h, eps)
        # One state slot tensor (engine/mtp_head.py): the target's final hidden state at each
        # sequence's last computed position, [slots, hidden], bound by the cache pool.
        self.state_shapes, self.state_dtypes = ((h,),), (ctx.dtype,)
        self.states: tuple[torch.Tensor, ...] = ()

    def forward(self, embeds: torch.Tensor, hidden_states: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = torch.cat([self.pre_fc_norm_embedding(embeds),
                       self.pre_fc_norm_hidden(hidden_states)], -1)
        x, residual = self.layers[0](rope, self.fc(x), None)
        return self.norm(x, residual)[0]


def num_mtp_layers(config) -> int:
    """The checkpoint's MTP layers: mtp_num_hidden_layers (Qwen3.5) or num_nextn_predict_layers
    (Qwen3-Next), 0 where its config names neither."""
    for field in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if getattr(config, field, None) is not None:
            return int(getattr(config, field))
    return 0


def build_mtp(ctx: ModelContext, config, heads: Heads, mlp=None) -> Qwen3_5MTP | None:
    """The MTP head where Heads.mtp asks for it, refused by name where the config has none or
    more than the one layer vlinfer runs."""
    if not heads.mtp:
        return None
    n = num_mtp_layers(config)
    if n != 1:
        raise ValueError(
            "speculative_config: method='mtp' runs a checkpoint's one MTP layer; this config has "
            f"{n} (mtp_num_hidden_layers / num_nextn_predict_layers)")
    return Qwen3_5MTP(ctx, config, mlp)


def mtp_weights(model: nn.Module, weights: Iterable):
    """A checkpoint stream without its mtp.* tensors where the model holds no MTP head (skipped
    unread, said once); as is otherwise."""
    skipped = 0
    for name, tensor in weights:
        if model.mtp is None and name.startswith(MTP_PREFIX):
            skipped += 1
            continue
        yield name, tensor
    if skipped:
        logger.info("%d MTP head tensors (mtp.*) skipped: speculative_config method='mtp' "
                    "loads them", skipped)


class Qwen3_5MTPRunner(HasMTPHead):
    """HasMTPHead for the Qwen3.5 family: `mtp_language_model()` is the decoder whose embedding
    and rotary the head shares."""

    def mtp_language_model(self) -> "Qwen3_5Model":
        raise NotImplementedError

    def mtp_embeds(self, input_ids, mm_embeds=None, mm_mask=None, **_):
        rows = self.mtp_language_model().embed_tokens(input_ids)
        if mm_mask is not None and mm_embeds is not None:
            rows[mm_mask] = mm_embeds.to(rows.dtype)
        return rows

    def mtp_forward(self, embeds, hidden_states, positions):
        rope = self.mtp_language_model().rotary_emb.cos_sin(positions, hidden_states.dtype)
        return self.mtp(embeds, hidden_states, rope)


class Qwen3_5ForCausalLM(nn.Module, HasStateSlots, SupportsPooling, Qwen3_5MTPRunner,
                         OwnsWeightLoading):
    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj", 0),
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }

    def __init__(self, config, ctx: ModelContext, heads: Heads = Heads()):
        super().__init__()
        self.config = config
        self.model = Qwen3_5Model(ctx, config)
        self.lm_head = build_lm_head(ctx, config, self.model.embed_tokens,
                                     config.tie_word_embeddings, heads)
        self.mtp = build_mtp(ctx, config, heads)
        self.classifier = build_classifier(ctx, config, heads)  # registered last: loaded last

    def state_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.modules() if isinstance(m, GatedDeltaNet)]

    def mtp_language_model(self) -> Qwen3_5Model:
        return self.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, mtp_weights(self, weights))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
