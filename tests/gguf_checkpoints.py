"""Tiny Llama GGUF files written with the `gguf` package the way llama.cpp's converter writes them:
seeded random weights, the q / k rows permuted for ggml's rotary (transformers reverses it on load),
every 2-D weight quantized to one block type (gguf-py's own quantizer), norms in F32, and a small
byte-level BPE vocabulary (the 256 byte symbols, one merge and the chat specials) so that
transformers' GGUF tokenizer conversion runs."""
import os

import numpy as np

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
