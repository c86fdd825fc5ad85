"""llama.cpp's `qwen35` GGUF files (Qwen3.5 text), which transformers' GGUF loader does not read:
the config from the file's header and each tensor under its Hugging Face name with llama.cpp's
conversion (conversion/qwen.py Qwen3NextModel + _LinearAttentionVReorderBase) undone:
- value heads stored tiled ([k0v0, k1v0, k0v1, k1v1]) for ggml's broadcast, back to grouped by key
  head ([k0v0, k0v1, k1v0, k1v1]): in_proj_qkv's v rows, in_proj_z, in_proj_b / in_proj_a, A_log,
  dt_bias, the conv's v channels (row orders: exact on Q8_0 / Q4_0 / Q4_1 block rows too) and
  out_proj's columns (a column order inside blocks: that tensor is dequantized when reordered);
- ssm_a = -exp(A_log) back to A_log = log(-ssm_a); ssm_dt.bias is dt_bias;
- every RMSNorm but the gated one stored as 1 + weight, back to the weight (the model adds 1 again).
The header names the layers only by `full_attention_interval` (every interval-th layer is full
attention), as llama.cpp reads them. The qwen35moe architecture (fused experts) is refused by name.
"""
from types import SimpleNamespace

import numpy as np

ARCHITECTURES = {"qwen35": "Qwen3_5ForCausalLM"}
REFUSED = {"qwen35moe": "Qwen3.5-MoE GGUF files (qwen35moe) are not read yet: their fused experts "
                        "have no loader here; open the safetensors checkpoint"}
# per decoder layer: the Hugging Face names that llama.cpp's tensor map covers
LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight",
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
    """The Qwen3_5TextConfig a qwen35 file's header describes."""
    from transformers import Qwen3_5TextConfig

    def value(key: str):
        return header_value(reader, f"qwen35.{key}")

    layers, interval = value("block_count"), value("full_attention_interval")
    head_dim, rope_dim = value("attention.key_length"), value("rope.dimension_count")
    sections = list(value("rope.dimension_sections"))[:3]
    tensors = {t.name: t for t in reader.tensors}
    vocab = int(tensors["token_embd.weight"].shape[1])  # ggml lists ne[0] (hidden) first
    value_heads = value("ssm.time_step_rank")
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=value("embedding_length"),
        intermediate_size=value("feed_forward_length"), num_hidden_layers=layers,
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
        architectures=[ARCHITECTURES["qwen35"]])


def _optional(reader, key: str):
    return header_value(reader, key) if key in reader.fields else None


def hf_names(config) -> dict[str, str]:
    """{gguf tensor name: Hugging Face name} through gguf-py's own tensor map for qwen35."""
    import gguf
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, config.num_hidden_layers)
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{leaf}" for i in range(config.num_hidden_layers)
        for leaf in LAYER_TENSORS]
    mapping = {}
    for name in hf:
        # llama.cpp renames dt_bias to dt_proj.bias before its tensor map
        stored = name.replace(".dt_bias", ".dt_proj.bias")
        gguf_name = names.get_name(stored, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            mapping[gguf_name] = name
    return mapping


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
        self.num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
        self.per_k = num_v // self.num_k
        self.qk_rows = 2 * self.num_k * config.linear_key_head_dim
        self.head_v = config.linear_value_head_dim

    def keeps_blocks(self, gguf_name: str) -> bool:
        """Whether a tensor may stay in its blocks: all but a reordered out_proj (its columns)."""
        return not (self.per_k > 1 and self.mapping.get(gguf_name, "").endswith(".out_proj.weight"))

    def process(self, weights: np.ndarray, name: str, **_) -> SimpleNamespace:
        hf = self.mapping.get(name, "")
        leaf = hf.rsplit(".", 2)[-2] if hf.endswith((".weight", ".bias")) else hf.rsplit(".", 1)[-1]
        if leaf == "A_log":
            weights = np.log(-weights)
        elif hf.endswith("norm.weight") and ".linear_attn.norm." not in hf:
            weights = weights - 1
        if ".linear_attn." in hf and self.per_k > 1:
            weights = self._grouped(leaf, weights)
        return SimpleNamespace(name=name, weights=weights)

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
