"""Tiny random text checkpoints of the real architectures (Qwen3, Llama) saved with the real Qwen3
tokenizer, and transformers' Qwen3-VL processor as a user of a checkpoint builds it."""
import os
import shutil

import torch

from dependencies import qwen_tokenizer_dir


def tiny_text_config(family: str, tie: bool, num_kv_heads: int = 2):
    """A small transformers config of the real architecture: GQA, 2 layers, vocab 512."""
    from transformers import LlamaConfig, Qwen3Config
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16,
                  max_position_embeddings=512, tie_word_embeddings=tie, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3":
        return Qwen3Config(**common,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def build_checkpoint(path, config, seed: int = 0):
    """Save a seeded random transformers model (safetensors) with the real Qwen3 tokenizer beside
    it."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(qwen_tokenizer_dir()):
        shutil.copy(os.path.join(qwen_tokenizer_dir(), name), path)
    return model


def hf_qwen3_vl_processor(folder: str, chat_template: str | None = None):
    """transformers' Qwen3VLProcessor as a user of a checkpoint builds it: the folder's preprocessor
    config and the real Qwen3 tokenizer. It expands <|image_pad|> itself, so a comparison with it
    checks our expansion."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
                            tokenizer=AutoTokenizer.from_pretrained(qwen_tokenizer_dir()),
                            video_processor=Qwen3VLVideoProcessor(), chat_template=chat_template)
