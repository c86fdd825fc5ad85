"""Llama family decoder (Llama 2/3, SmolLM2, ...) and the shared decoder body Qwen3 reuses."""
import torch
from torch import nn

from vlinfer.layers import (Attention, MergedColumnParallelLinear, ModelContext, ParallelLMHead,
                            QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                            SiluAndMul, VocabParallelEmbedding)
from vlinfer.layers.pooler import TokenRowsHead
from vlinfer.models.interfaces import (Heads, PagedAttentionBlock, SupportsFusedDecode,
                                       SupportsPooling)


class LlamaAttention(nn.Module, PagedAttentionBlock):
    def __init__(self, ctx: ModelContext, config, qk_norm: bool = False):
        super().__init__()
        self.ops = ctx.ops
        self.head_dim = getattr(config, "head_dim",
                                None) or config.hidden_size // config.num_attention_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(ctx, config.hidden_size, self.head_dim,
                                          config.num_attention_heads, config.num_key_value_heads,
                                          bias=bias)
        # This rank's heads: query heads split evenly; KV heads split, or one replicated when fewer
        # than ranks.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(ctx, config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=bias)
        self.attn = Attention(ctx, self.num_heads, self.head_dim, self.head_dim**-0.5,
                              self.num_kv_heads)
        if qk_norm:  # Qwen3: RMSNorm over each head's q and k before rotary
            self.q_norm = RMSNorm(ctx, self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(ctx, self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor],
                hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, ctx: ModelContext, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(ctx, config.hidden_size,
                                                       [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(ctx, config.intermediate_size, config.hidden_size,
                                           bias=bias)
        # the fused SiLU-and-multiply is the only activation these layers run
        if config.hidden_act != "silu":
            raise ValueError(
                f"unsupported activation hidden_act={config.hidden_act!r} in the checkpoint's "
                "config; "
                "this model class runs 'silu' only")
        self.act_fn = SiluAndMul(ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, config, qk_norm: bool = False,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(ctx, config, qk_norm)
        # MoE models pass their sparse block
        self.mlp = mlp if mlp is not None else LlamaMLP(ctx, config)
        self.input_layernorm = RMSNorm(ctx, config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(ctx, config.hidden_size, config.rms_norm_eps)

    def decode_weights(self) -> dict | None:
        """This layer's weights by name for an op table's fused decode layers
        (ops.dense_decode_stack): each projection its dense weight or its quantization method's
        decode_weight; None where it has no fused form: a sparse MLP, a quantized projection
        without one, or tensor parallel (the row-parallel projections' all-reduce)."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, LlamaMLP):
            return None
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        if attn.o_proj.tp.size != 1:
            return None
        qkv, o, gate_up, down = [
            linear.weight if linear.method is None else linear.method.decode_weight(linear)
            for linear in linears
        ]
        if any(w is None for w in (qkv, o, gate_up, down)):
            return None
        q_norm, k_norm = (attn.q_norm.weight,
                          attn.k_norm.weight) if attn.q_norm is not None else (None, None)
        return dict(input_norm=self.input_layernorm.weight,
                    post_norm=self.post_attention_layernorm.weight, qkv=qkv,
                    qkv_bias=attn.qkv_proj.bias, q_norm=q_norm, k_norm=k_norm, o=o,
                    o_bias=attn.o_proj.bias, gate_up=gate_up, gate_up_bias=mlp.gate_up_proj.bias,
                    down=down, down_bias=mlp.down_proj.bias)

    def forward(self, rope, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rope, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module, SupportsFusedDecode):
    def __init__(self, ctx: ModelContext, config, qk_norm: bool = False,
                 rotary_emb: nn.Module | None = None, make_mlp=None):
        """make_mlp(layer_index) -> the layer's MLP module (MoE models), or None: the dense
        LlamaMLP."""
        super().__init__()
        # One rotary for all layers: its cos/sin are computed once per step and shared.
        self.rotary_emb = rotary_emb or RotaryEmbedding(config, config.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(ctx, config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([
            LlamaDecoderLayer(ctx, config, qk_norm,
                              make_mlp(i) if make_mlp else None)
            for i in range(config.num_hidden_layers)
        ])
        self.norm = RMSNorm(ctx, config.hidden_size, config.rms_norm_eps)
        self.ctx = ctx
        # the layers fused for decode steps (fuse_decode), where the op table has them
        self.decode_stack = None

    def fuse_decode(self) -> bool:
        """Let decode steps run every layer in one op call (ops.dense_decode_stack), once after
        packing; False where a layer has no fused form or the op table fuses none."""
        quantized = self.ctx.kv_cache_quantized
        # a static int8 cache moves its scales onto the query and the output
        # (Attention._static_int8), which the stack does not
        if quantized and any(layer.self_attn.attn.static_kv_scales is not None
                             for layer in self.layers):
            return False
        weights = [layer.decode_weights() for layer in self.layers]
        if not weights or any(w is None for w in weights):
            return False
        attn = self.layers[0].self_attn
        qk_eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
        self.attention_caches = [layer.self_attn.attn for layer in self.layers]
        self.decode_stack = self.ctx.ops.dense_decode_stack(weights, num_heads=attn.num_heads,
                                                            num_kv_heads=attn.num_kv_heads,
                                                            head_dim=attn.head_dim,
                                                            scale=attn.attn.scale,
                                                            eps=self.layers[0].input_layernorm.eps,
                                                            qk_eps=qk_eps,
                                                            kv_cache_dtype=self.ctx.kv_cache_dtype
                                                            if quantized else None)
        return self.decode_stack is not None

    def run_layers(self, rope, hidden_states: torch.Tensor):
        """Every decoder layer: (the last layer's mlp output, residual). A decode-only step runs the
        fused stack where there is one."""
        step = self.ctx.forward_context()
        # adapters: layer by layer
        if self.decode_stack is not None and step.decode_only and step.lora is None:
            # each layer's cache views, bound by the model runner after fusing
            caches = self.attention_caches
            scaled = caches[0].k_scale is not None  # a cache in another dtype
            return self.decode_stack.forward(hidden_states, *rope, [c.k_cache for c in caches],
                                             [c.v_cache for c in caches], step.slot_mapping,
                                             step.block_tables, step.seq_lens,
                                             [c.k_scale for c in caches] if scaled else [],
                                             [c.v_scale for c in caches] if scaled else [])
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(rope, hidden_states, residual)
        return hidden_states, residual

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        hidden_states, residual = self.run_layers(rope, hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def build_lm_head(ctx: ModelContext, text_config, embed_tokens: nn.Module, tied: bool,
                  heads: Heads) -> ParallelLMHead | None:
    """The LM head, sharing the embedding's table when tied; None for a model built without one."""
    if not heads.lm_head:
        return None
    lm_head = ParallelLMHead(ctx, text_config.vocab_size, text_config.hidden_size)
    if tied:
        lm_head.weight = embed_tokens.weight
    return lm_head


def build_classifier(ctx: ModelContext, text_config, heads: Heads) -> TokenRowsHead | None:
    """A reranker's label rows of the LM head (filled from its table as the checkpoint loads)."""
    if heads.classifier_token_ids is None:
        return None
    return TokenRowsHead(ctx, list(heads.classifier_token_ids), text_config.hidden_size)


class LlamaForCausalLM(nn.Module, SupportsPooling):
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False

    def __init__(self, config, ctx: ModelContext, heads: Heads = Heads()):
        super().__init__()
        self.config = config
        self.model = LlamaModel(ctx, config, self.qk_norm)
        self.lm_head = build_lm_head(ctx, config, self.model.embed_tokens,
                                     config.tie_word_embeddings, heads)
        self.classifier = build_classifier(ctx, config, heads)  # registered last: loaded last

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
