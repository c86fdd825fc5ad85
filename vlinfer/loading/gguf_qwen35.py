"""llama.cpp's `qwen35` and `qwen35moe` GGUF files (Qwen3.5 and Qwen3.5-MoE text), which
transformers' GGUF loader does not read:
the config from the file's header and each tensor under its Hugging Face name with llama.cpp's
conversion (conversion/qwen.py Qwen3NextModel + _LinearAttentionVReorderBase) undone:
- value heads stored tiled ([k0v0, k1v0, k0v1, k1v1]) for ggml's broadcast, back to grouped by key
  head ([k0v0, k0v1, k1v0, k1v1]): in_proj_qkv's v rows, in_proj_z, in_proj_b / in_proj_a, A_log,
  dt_bias, the conv's v channels (row orders: exact on Q8_0 / Q4_0 / Q4_1 block rows too) and
  out_proj's columns (a column order inside blocks: that tensor is dequantized when reordered);
- ssm_a = -exp(A_log) back to A_log = log(-ssm_a); ssm_dt.bias is dt_bias;
- every RMSNorm but the gated one stored as 1 + weight, back to the weight (the model adds 1 again).
The header names the layers only by `full_attention_interval` (every interval-th layer is full
attention), as llama.cpp reads them. qwen35moe's routed experts come stacked per layer
(ffn_gate_exps / ffn_up_exps [E, I, H], or ffn_gate_up_exps, and ffn_down_exps [E, H, I]): they
are dequantized and joined into transformers' in-memory gate_up_proj [E, 2I, H] / down_proj, as
transformers' Qwen2MoeTensorProcessor does for qwen3moe files (the experts have no block kernel);
the shared expert (ffn_*_shexp) keeps its blocks, its gate ffn_gate_inp_shexp ([H] in the file)
and the router ffn_gate_inp load dense.
"""
from types import SimpleNamespace

import numpy as np

ARCHITECTURES = {"qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
# per decoder layer: the Hugging Face names that llama.cpp's tensor map covers
DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
MOE_MLP = ("mlp.gate.weight", "mlp.shared_expert.gate_proj.weight",
           "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
           "mlp.shared_expert_gate.weight")
# the stacked experts' GGUF leaves (".weight" in the file) -> the Hugging Face tensor they fill
EXPERT_TENSORS = {"ffn_gate_exps": "mlp.experts.gate_up_proj",
                  "ffn_up_exps": "mlp.experts.gate_up_proj",
                  "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
                  "ffn_down_exps": "mlp.experts.down_proj"}
LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
    "linear_attn.out_proj.weight", "linear_attn.conv1d.weight", "linear_attn.norm.weight",
    "linear_attn.A_log", "linear_attn.dt_bias")


# GGUF value types' sizes (the spec's gguf_type: 8 is a string, 9 an array)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def peek_architecture(path: str) -> str | None:
    """general.architecture, read from the header's key-value pairs without parsing the tensor
    infos or the vocabulary's values into objects; None when the file does not say (a reader
    downstream then names the problem)."""
    import struct
    try:
        return _peek(path, struct)
    except (struct.error, OSError, KeyError, MemoryError, OverflowError):
        return None  # a damaged header: gguf-py's reader, which runs next, names what is wrong


def _peek(path: str, struct) -> str | None:
    with open(path, "rb") as f:
        def take(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(take("Q"), 1)
            elif kind == 9:
                inner, count = take("I"), take("Q")
                if inner in _SCALAR_BYTES:
                    f.seek(count * _SCALAR_BYTES[inner], 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                f.seek(_SCALAR_BYTES[kind], 1)

        if f.read(4) != b"GGUF" or take("I") < 2:
            return None
        take("Q")  # tensor count
        for _ in range(take("Q")):
            key = f.read(take("Q")).decode(errors="replace")
            kind = take("I")
            if key == "general.architecture" and kind == 8:
                return f.read(take("Q")).decode(errors="replace")
            if kind not in _SCALAR_BYTES and kind not in (8, 9):
                return None
            skip(kind)
    return None


def header_value(reader, key: str):
    """A header field: an int / float / str, or a list for an array; KeyError naming it."""
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"the GGUF header has no {key!r}")
    values = [field.parts[i] for i in field.data]
    if field.types and field.types[0].name == "STRING":
        return bytes(values[0]).decode()
    scalars = [v.tolist()[0] for v in values]
    return scalars if field.types[0].name == "ARRAY" else scalars[0]


def read_config(reader):
    """The Qwen3_5TextConfig (qwen35) or Qwen3_5MoeTextConfig (qwen35moe) a file's header
    describes."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    arch = header_value(reader, "general.architecture")

    def value(key: str):
        return header_value(reader, f"{arch}.{key}")

    layers, interval = value("block_count"), value("full_attention_interval")
    head_dim, rope_dim = value("attention.key_length"), value("rope.dimension_count")
    sections = list(value("rope.dimension_sections"))[:3]
    tensors = {t.name: t for t in reader.tensors}
    vocab = int(tensors["token_embd.weight"].shape[1])  # ggml lists ne[0] (hidden) first
    value_heads = value("ssm.time_step_rank")
    if arch == "qwen35moe":
        make, mlp = Qwen3_5MoeTextConfig, dict(
            num_experts=value("expert_count"), num_experts_per_tok=value("expert_used_count"),
            moe_intermediate_size=value("expert_feed_forward_length"),
            shared_expert_intermediate_size=value("expert_shared_feed_forward_length"))
    else:
        make, mlp = Qwen3_5TextConfig, dict(intermediate_size=value("feed_forward_length"))
    return make(
        vocab_size=vocab, hidden_size=value("embedding_length"), **mlp, num_hidden_layers=layers,
        layer_types=["linear_attention" if (i + 1) % interval else "full_attention"
                     for i in range(layers)],
        num_attention_heads=value("attention.head_count"),
        num_key_value_heads=value("attention.head_count_kv"), head_dim=head_dim,
        linear_num_key_heads=value("ssm.group_count"), linear_num_value_heads=value_heads,
        linear_key_head_dim=value("ssm.state_size"),
        linear_value_head_dim=value("ssm.inner_size") // value_heads,
        linear_conv_kernel_dim=value("ssm.conv_kernel"),
        rms_norm_eps=value("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=value("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        rope_parameters={"rope_type": "default", "rope_theta": value("rope.freq_base"),
                         "partial_rotary_factor": rope_dim / head_dim,
                         "mrope_section": sections, "mrope_interleaved": True},
        bos_token_id=_optional(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_optional(reader, "tokenizer.ggml.eos_token_id"),
        architectures=[ARCHITECTURES[arch]])


def _optional(reader, key: str):
    return header_value(reader, key) if key in reader.fields else None


def is_moe(config) -> bool:
    return hasattr(config, "num_experts")


def hf_names(config) -> dict[str, str]:
    """{gguf tensor name: Hugging Face name} through gguf-py's own tensor map for qwen35 /
    qwen35moe (the stacked experts: EXPERT_TENSORS)."""
    import gguf
    moe = is_moe(config)
    arch = gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{leaf}" for i in range(config.num_hidden_layers)
        for leaf in LAYER_TENSORS + (MOE_MLP if moe else DENSE_MLP)]
    mapping = {f"blk.{i}.{leaf}.weight": f"model.layers.{i}.{hf_leaf}"
               for i in range(config.num_hidden_layers) if moe
               for leaf, hf_leaf in EXPERT_TENSORS.items()}
    for name in hf:
        # llama.cpp renames dt_bias to dt_proj.bias before its tensor map
        stored = name.replace(".dt_bias", ".dt_proj.bias")
        gguf_name = names.get_name(stored, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            mapping[gguf_name] = name
    return mapping


def _block_leaf(gguf_name: str) -> str:
    """"ffn_up_exps" of "blk.3.ffn_up_exps.weight"; "" for a tensor outside the blocks."""
    parts = gguf_name.split(".")
    return parts[2] if parts[0] == "blk" and len(parts) > 2 else ""


def _to_grouped(w: np.ndarray, dim: int, num_k: int, per_k: int, head_dim: int) -> np.ndarray:
    """Value heads tiled [per_k, num_k, head_dim] along `dim` back to grouped [num_k, per_k]."""
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], per_k, num_k, head_dim, *shape[dim + 1:])
    return np.ascontiguousarray(np.swapaxes(w, dim, dim + 1)).reshape(shape)


class Qwen35TensorProcessor:
    """Undoes llama.cpp's conversion of one tensor (the module doc), in transformers'
    TensorProcessor interface that loading/gguf.py drives."""

    def __init__(self, config, mapping: dict[str, str]):
        self.mapping = mapping
        # a layer's gate or up experts, waiting for the other half
        self._gate_halves: dict[str, tuple[str, np.ndarray]] = {}
        self.num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
        self.per_k = num_v // self.num_k
        self.qk_rows = 2 * self.num_k * config.linear_key_head_dim
        self.head_v = config.linear_value_head_dim

    def keeps_blocks(self, gguf_name: str) -> bool:
        """Whether a tensor may stay in its blocks: all but a reordered out_proj (its columns) and
        the router (the experts, 3-D, never do)."""
        hf = self.mapping.get(gguf_name, "")
        return not (self.per_k > 1 and hf.endswith(".out_proj.weight")
                    or hf.endswith(".mlp.gate.weight"))

    def index_shape(self, gguf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face shape of what a tensor becomes (a gate or up half of [E, 2I, H],
        the shared-expert gate [1, H])."""
        leaf = _block_leaf(gguf_name)
        if leaf in ("ffn_gate_exps", "ffn_up_exps"):
            return (shape[0], 2 * shape[1], shape[2])
        return (1, *shape) if leaf == "ffn_gate_inp_shexp" and len(shape) == 1 else shape

    def process(self, weights: np.ndarray, name: str, **_) -> SimpleNamespace:
        leaf = _block_leaf(name)
        if leaf in ("ffn_gate_exps", "ffn_up_exps"):
            return self._join_gate_up(weights, name, leaf)
        if leaf == "ffn_gate_inp_shexp" and weights.ndim == 1:
            weights = weights[None]  # llama.cpp stores the [1, H] gate as [H]
        hf = self.mapping.get(name, "")
        leaf = hf.rsplit(".", 2)[-2] if hf.endswith((".weight", ".bias")) else hf.rsplit(".", 1)[-1]
        if leaf == "A_log":
            weights = np.log(-weights)
        elif hf.endswith("norm.weight") and ".linear_attn.norm." not in hf:
            weights = weights - 1
        if ".linear_attn." in hf and self.per_k > 1:
            weights = self._grouped(leaf, weights)
        return SimpleNamespace(name=name, weights=weights)

    def _join_gate_up(self, weights: np.ndarray, name: str, leaf: str) -> SimpleNamespace:
        """A layer's gate and up experts (either first) as one [E, 2I, H], gate rows first; the
        first of the two is held back (name None: not yielded)."""
        layer = self.mapping[name]
        other = self._gate_halves.pop(layer, None)
        if other is None:
            self._gate_halves[layer] = (leaf, weights)
            return SimpleNamespace(name=None, weights=None)
        if other[0] == leaf:
            raise ValueError(f"the GGUF file holds {leaf} twice for {layer}")
        gate, up = (other[1], weights) if leaf == "ffn_up_exps" else (weights, other[1])
        return SimpleNamespace(name=name, weights=np.concatenate([gate, up], axis=1))

    def _grouped(self, leaf: str, w: np.ndarray) -> np.ndarray:
        k, per_k, dv, qk = self.num_k, self.per_k, self.head_v, self.qk_rows
        if leaf in ("in_proj_qkv", "conv1d"):
            return np.concatenate([w[:qk], _to_grouped(w[qk:], 0, k, per_k, dv)])
        if leaf == "in_proj_z":
            return _to_grouped(w, 0, k, per_k, dv)
        if leaf in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
            return _to_grouped(w, 0, k, per_k, 1)
        if leaf == "out_proj":
            return _to_grouped(w, 1, k, per_k, dv)
        return w
