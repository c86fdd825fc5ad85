"""Tiny Llama GGUF files written with the `gguf` package the way llama.cpp's converter writes them:
seeded random weights, the q / k rows permuted for ggml's rotary (transformers reverses it on load),
every 2-D weight quantized to one block type (gguf-py's own quantizer), norms in F32, and a small
byte-level BPE vocabulary (the 256 byte symbols, one merge and the chat specials) so that
transformers' GGUF tokenizer conversion runs."""
import os

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DIMS = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 symbols a byte-level BPE vocabulary starts from."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert permutation of q / k rows (the inverse of transformers' reverse_permute).
    """
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1,
                                                                                2).reshape(w.shape)


def write_tiny_llama_gguf(path: str, type_name: str, seed: int = 0,
                          tie_embeddings: bool = True) -> str:
    """A 2-layer Llama GGUF at `path` with every 2-D weight in `type_name` blocks (Q8_0, Q4_0,
    Q4_1)."""
    import gguf
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    d = DIMS
    head_dim = d["hidden"] // d["heads"]
    tokens = _byte_symbols() + ["\u0120t"] + SPECIALS  # one merge ("Ġ t": " t"), then the specials
    vocab = len(tokens)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(512)
    writer.add_embedding_length(d["hidden"])
    writer.add_block_count(d["layers"])
    writer.add_feed_forward_length(d["intermediate"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_file_type({
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1
    }[type_name])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3] * len(SPECIALS))
    writer.add_token_merges(["\u0120 t"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(259)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def weight(name: str, rows: int, cols: int, scale: float = 0.2):
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if ".attn_q." in name:
            w = _permute(w, d["heads"])
        elif ".attn_k." in name:
            w = _permute(w, d["kv_heads"])
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    def norm(name: str):
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(d["hidden"])).astype(np.float32))

    weight("token_embd.weight", vocab, d["hidden"], 1.0)
    h, kv = d["hidden"], d["kv_heads"] * head_dim
    for i in range(d["layers"]):
        norm(f"blk.{i}.attn_norm.weight")
        weight(f"blk.{i}.attn_q.weight", h, h)
        weight(f"blk.{i}.attn_k.weight", kv, h)
        weight(f"blk.{i}.attn_v.weight", kv, h)
        weight(f"blk.{i}.attn_output.weight", h, h)
        norm(f"blk.{i}.ffn_norm.weight")
        weight(f"blk.{i}.ffn_gate.weight", d["intermediate"], h)
        weight(f"blk.{i}.ffn_up.weight", d["intermediate"], h)
        weight(f"blk.{i}.ffn_down.weight", h, d["intermediate"])
    norm("output_norm.weight")
    if not tie_embeddings:
        weight("output.weight", vocab, d["hidden"], 0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.path.abspath(path)


def _reorder_v_heads(w: np.ndarray, dim: int, num_k: int, per_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp's _LinearAttentionVReorderBase: value heads from grouped by key head
    [k0v0, k0v1, k1v0, k1v1] to tiled [k0v0, k1v0, k0v1, k1v1] along `dim`."""
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], num_k, per_k, head_dim, *shape[dim + 1:])
    return np.swapaxes(w, dim, dim + 1).reshape(shape)


def write_tiny_qwen35_gguf(model, path: str, type_name: str,
                           permute_experts: bool = False) -> tuple[str, dict]:
    """A `qwen35` GGUF of a transformers Qwen3_5ForCausalLM, written as llama.cpp's converter
    (conversion/qwen.py Qwen3NextModel + _LinearAttentionVReorderBase) writes one: the value heads
    of in_proj_qkv's v rows, in_proj_z, in_proj_b / in_proj_a, A_log / dt_bias, the conv's v
    channels and out_proj's columns reordered from grouped to tiled; A_log stored as
    ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; the conv squeezed to [channels, kernel]; every
    RMSNorm but the gated one stored as 1 + weight; 2-D weights (not the conv) in `type_name`
    blocks, the rest F32. The vocabulary is the byte-level one of write_tiny_llama_gguf. Returns
    (path, the dequantized twin's weights: {Hugging Face name: each block-stored weight as gguf-py
    dequantizes it, its reorder undone by the inverse permutation}).
    A Qwen3_5MoeForCausalLM is written as `qwen35moe`: the routed experts stacked per layer as
    ffn_gate_exps / ffn_up_exps [E, I, H] and ffn_down_exps [E, H, I] in `type_name` blocks (the
    twin holds them dequantized and joined into gate_up_proj), the shared expert as ffn_*_shexp,
    its gate as ffn_gate_inp_shexp [H] and the router ffn_gate_inp in F32 (llama.cpp keeps both
    F32). permute_experts (a planted mistake) writes every layer's experts one place further on,
    their router unchanged."""
    import gguf
    qtype = gguf.GGMLQuantizationType[type_name]
    c = model.config
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv, per_k = c.linear_key_head_dim, c.linear_value_head_dim, nv // nk
    interval = c.layer_types.index("full_attention") + 1
    assert c.layer_types == [("linear_attention" if (i + 1) % interval else "full_attention")
                             for i in range(c.num_hidden_layers)]
    tokens = _byte_symbols() + ["\u0120t"] + SPECIALS
    assert len(tokens) == c.vocab_size
    moe = hasattr(c, "num_experts")
    arch = "qwen35moe" if moe else "qwen35"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    if moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    else:
        writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(c.head_dim * rope["partial_rotary_factor"]))
    writer.add_rope_dimension_sections(list(rope["mrope_section"]) + [0])
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(nk)
    writer.add_ssm_time_step_rank(nv)
    writer.add_ssm_inner_size(dv * nv)
    writer.add_full_attention_interval(interval)
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3] * len(SPECIALS))
    writer.add_token_merges(["\u0120 t"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(259)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    twin = {}
    for name, tensor in model.state_dict().items():
        hf_name = name
        w = tensor.float().numpy()
        if ".mlp.experts." in name:
            twin[hf_name] = _write_experts(writer, name, w, qtype, permute_experts)
            continue
        if name.endswith(".mlp.shared_expert_gate.weight") or name.endswith(".mlp.gate.weight"):
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)),
                              np.ascontiguousarray(w.squeeze(0) if w.shape[0] == 1 else w))
            continue
        # where each stored row / column comes from: the reorders below applied to indices
        rows, cols = np.arange(w.shape[0]), np.arange(w.shape[-1])
        if name.endswith(".A_log"):
            w = -np.exp(w)
        elif name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif "conv1d" in name:
            w = w.squeeze(1)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1
        if "linear_attn." in name and per_k > 1:
            if ".in_proj_qkv." in name or "conv1d" in name:
                rows = np.concatenate([rows[:2 * nk * dk],
                                       _reorder_v_heads(rows[2 * nk * dk:], 0, nk, per_k, dv)])
            elif ".in_proj_z." in name:
                rows = _reorder_v_heads(rows, 0, nk, per_k, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or \
                    ".dt_proj" in name:
                rows = _reorder_v_heads(rows, 0, nk, per_k, 1)
            elif ".out_proj." in name:
                cols = _reorder_v_heads(cols, 0, nk, per_k, dv)
            w = w[rows] if w.ndim == 1 else w[rows][:, cols]
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 2 and "conv1d" not in name:
            blocks = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            stored = gguf.quants.dequantize(blocks, qtype)
            twin[hf_name] = torch.from_numpy(
                stored[np.argsort(rows)][:, np.argsort(cols)].astype(np.float32))
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.path.abspath(path), twin


def _write_experts(writer, name: str, w: np.ndarray, qtype, permute: bool) -> torch.Tensor:
    """One layer's stacked experts as llama.cpp writes them (gate_up_proj split into
    ffn_gate_exps and ffn_up_exps); returns them as gguf-py dequantizes them, joined again."""
    import gguf
    layer = name.split(".")[2]
    if permute:
        w = np.roll(w, 1, axis=0)
    if name.endswith("gate_up_proj"):
        half = w.shape[1] // 2
        parts = {"ffn_gate_exps": w[:, :half], "ffn_up_exps": w[:, half:]}
    else:
        parts = {"ffn_down_exps": w}
    stored = []
    for leaf, part in parts.items():
        blocks = gguf.quants.quantize(np.ascontiguousarray(part, dtype=np.float32), qtype)
        writer.add_tensor(f"blk.{layer}.{leaf}.weight", blocks, raw_dtype=qtype)
        stored.append(gguf.quants.dequantize(blocks, qtype))
    joined = np.concatenate(stored, axis=1)
    return torch.from_numpy(np.roll(joined, -1, axis=0) if permute else joined)
