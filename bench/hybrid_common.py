"""The Qwen3.5 parts of bench/hybrid_throughput.py: the published shapes with random weights, the
checkpoint built once, and the arithmetic of what a decode step must read and what the engine's
pool must hold (the full-attention layers' KV and one state slot per running sequence).

The random checkpoints use the Qwen3-VL tokenizer (the one bench/vlm_throughput.py uses) and its
vision token ids, with Qwen3.5's own vocabulary size: the embedding and LM head have the real
shape, and prompts tokenize the same for every engine."""
import json
import os

import torch

from common import random_checkpoint
from vlm_common import PREPROCESSOR

SPECIAL = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
               vision_end_token_id=151653)
LAYER_TYPES_24 = (["linear_attention"] * 3 + ["full_attention"]) * 6
ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}
LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4)
VISION = dict(in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh",
              initializer_range=0.02)
# name -> (text config, vision config): the published config.json values (Qwen/Qwen3.5-0.8B,
# Qwen/Qwen3.5-2B); tiny: a few layers at a small width, for checking that the scripts run.
SHAPES = {
    "qwen3.5-0.8b": (
        dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
             num_attention_heads=8, num_key_value_heads=2, head_dim=256, **LINEAR),
        dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12,
             out_hidden_size=1024)),
    "qwen3.5-2b": (
        dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
             num_attention_heads=8, num_key_value_heads=2, head_dim=256, **LINEAR),
        dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
             out_hidden_size=2048)),
    "tiny": (
        dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
             linear_conv_kernel_dim=4),
        dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128)),
}


def qwen3_5_config(shape: str):
    """A Qwen3_5Config of `shape` (see SHAPES)."""
    from transformers import Qwen3_5Config
    text, vision = SHAPES[shape]
    layers = text["num_hidden_layers"]
    rope = dict(ROPE, mrope_section=[4, 2, 2]) if shape == "tiny" else ROPE
    text = dict(text, vocab_size=151936 if shape == "tiny" else 248320, rms_norm_eps=1e-6,
                max_position_embeddings=262144, hidden_act="silu", attention_bias=False,
                initializer_range=0.02, tie_word_embeddings=True, rope_parameters=rope,
                layer_types=(LAYER_TYPES_24 * 2)[:layers], full_attention_interval=4,
                bos_token_id=151643, eos_token_id=151645)
    return Qwen3_5Config(text_config=text, vision_config=dict(VISION, **vision),
                         tie_word_embeddings=True,
                         architectures=["Qwen3_5ForConditionalGeneration"], **SPECIAL)


def ensure_checkpoint(folder: str | None, shape: str, seed: int) -> str:
    """The random-weight checkpoint of `shape` in bf16 with its preprocessor config, built once
    (transformers' default init: modest magnitudes, fine for a throughput benchmark). The tiny one
    gets O(1) activations (the tests' rescaling): the default init's near-tied logits would make
    every engine emit the same token over and over, and a greedy comparison meaningless."""
    name = shape if shape.startswith("qwen3.5") else f"qwen3.5-{shape}"
    folder = folder or f"~/.cache/vlinfer/bench-{name}-random"

    def rescale(model):
        from vlinfer.toy.tiny_checkpoints import _rescale
        _rescale(model, torch.Generator().manual_seed(seed))

    return random_checkpoint(folder, shape, "Qwen3_5ForConditionalGeneration",
                             lambda: qwen3_5_config(shape), torch.bfloat16, seed,
                             files={"preprocessor_config.json": PREPROCESSOR},
                             init=rescale if shape == "tiny" else None)


def text_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)


def num_full_layers(t: dict) -> int:
    return sum(kind == "full_attention" for kind in t["layer_types"])


def kv_bytes_per_token(t: dict, element_size: int) -> int:
    """K and V of one token over the full-attention layers (the linear layers keep none)."""
    return 2 * num_full_layers(t) * t["num_key_value_heads"] * t["head_dim"] * element_size


def state_bytes_per_sequence(t: dict, element_size: int = 4) -> int:
    """One sequence's state over the linear layers: the conv state (q, k and v channels x
    kernel - 1) and the recurrent state (value heads x key dim x value dim), float32 by default."""
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_dim = t["linear_num_value_heads"] * t["linear_value_head_dim"]
    conv = (2 * key_dim + value_dim) * (t["linear_conv_kernel_dim"] - 1)
    recurrent = t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"]
    linear_layers = len(t["layer_types"]) - num_full_layers(t)
    return linear_layers * (conv + recurrent) * element_size


def decoder_weight_params(t: dict) -> dict[str, int]:
    """The language model's matmul weights a decode step reads, by kind: every linear of the
    linear-attention and full-attention layers, the MLPs and the LM head (the embedding is
    gathered a row at a time; norms and the conv weights are small and left out)."""
    h = t["hidden_size"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_dim = t["linear_num_value_heads"] * t["linear_value_head_dim"]
    heads = t["linear_num_value_heads"]
    linear = h * (2 * key_dim + value_dim + value_dim + 2 * heads) + value_dim * h
    q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
    full = h * (2 * q + 2 * kv) + q * h  # q_proj carries the output gate: twice the query width
    full_layers = num_full_layers(t)
    return {"linear-attention layers": (len(t["layer_types"]) - full_layers) * linear,
            "full-attention layers": full_layers * full,
            "MLPs": len(t["layer_types"]) * 3 * h * t["intermediate_size"],
            "LM head": h * t["vocab_size"]}


def decode_step_bytes(t: dict, weight_element: int, kv_element: int, context: int,
                      state_element: int = 4) -> dict[str, int]:
    """What one sequence's decode step must read at `context` tokens: the weights (in the compute
    dtype), the linear layers' state (read once; the write-back is not counted) and the
    full-attention KV of the context."""
    return {"weights": sum(decoder_weight_params(t).values()) * weight_element,
            "state": state_bytes_per_sequence(t, state_element),
            "KV": context * kv_bytes_per_token(t, kv_element)}


def pool_bytes(path: str, dtype: str, tokens_per_request: list[int], block_size: int = 16) -> int:
    """A cache pool holding every request at full length at once and a state slot each, so nothing
    waits or preempts: each request's KV blocks over the full-attention layers and its slot, plus
    a few spare blocks."""
    t = text_config(path)
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    blocks = sum(-(-n // block_size) for n in tokens_per_request) + 8
    return (blocks * block_size * kv_bytes_per_token(t, element)
            + (len(tokens_per_request) + 1) * state_bytes_per_sequence(t))
