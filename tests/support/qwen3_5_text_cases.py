"""Builders and constants of tests/models/test_qwen3_5_text.py that other test modules use too
(LAYER_TYPES, PROMPTS, checkpoint, make_llm, qwen3_5_moe_config, qwen3_next_config, save,
text_config): imported from here by every one of them, that module included."""
import os
import shutil

import pytest
import torch
from dependencies import qwen_tokenizer_dir
from vlinfer import LLM
from vlinfer.toy.tiny_checkpoints import _rescale

NUM_NEW = 24
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention",
                                                                 "full_attention"]
PROMPTS = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (5, 37, 70, 1)]


def text_config(**overrides):
    from transformers import Qwen3_5TextConfig
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
              layer_types=LAYER_TYPES, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
              linear_value_head_dim=48, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
              max_position_embeddings=1024, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2],
                               "mrope_interleaved": True},
              bos_token_id=1, eos_token_id=2, pad_token_id=0,
              architectures=["Qwen3_5ForCausalLM"])
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def save(model, folder: str) -> str:
    model.save_pretrained(folder, safe_serialization=True)
    for name in os.listdir(qwen_tokenizer_dir()):
        shutil.copy(os.path.join(qwen_tokenizer_dir(), name), folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, folder, [(prompt logits, greedy tokens)] per prompt)."""
    from transformers import Qwen3_5ForCausalLM
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5ForCausalLM(text_config()).eval()
    _rescale(model, torch.Generator().manual_seed(0))
    folder = save(model, str(tmp_path_factory.mktemp("qwen3_5_text")))
    # as ignore_eos: EOS may be chosen and generation goes on (min_new_tokens would mask it)
    model.generation_config.eos_token_id = None
    refs = []
    for ids in PROMPTS:
        ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
            out = model.generate(ids, max_new_tokens=NUM_NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        # each generated token's logprob, from the decode steps' logits (the recurrent path)
        steps = torch.cat(out.logits).float().log_softmax(-1)
        refs.append((logits, tokens, steps[range(NUM_NEW), tokens],
                     logits.log_softmax(-1)[range(ids.shape[1] - 1), ids[0, 1:]]))
    return model, folder, refs


def make_llm(path, **kw):
    kw.setdefault("kv_cache_bytes", 16 * 2 ** 20)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    return LLM(path, dtype="float32", **kw)


def qwen3_next_config():
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        layer_types=LAYER_TYPES, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=48, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=40, mlp_only_layers=[1], decoder_sparse_step=1,
        norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Qwen3NextForCausalLM"])


def qwen3_5_moe_config():
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, layer_types=LAYER_TYPES,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, shared_expert_intermediate_size=40,
        max_position_embeddings=1024, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Qwen3_5MoeForCausalLM"])
