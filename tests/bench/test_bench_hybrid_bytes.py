"""bench/hybrid_common.py's arithmetic of a Qwen3.5 decode step (the weights it reads by kind, one
sequence's state, the full-attention KV per token) against transformers' own model of the same
config: its linear weights counted by module, its state shapes read off its layers."""
import os
import sys

import pytest
import torch

from dependencies import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import hybrid_common  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    import transformers
    config = hybrid_common.qwen3_5_config("tiny").text_config
    with torch.device("meta"):  # shapes only
        model = transformers.Qwen3_5ForCausalLM(config)
    return config.to_dict(), model


def test_weights_by_kind_match_the_model_linears(tiny):
    t, model = tiny
    counted = {"linear-attention layers": 0, "full-attention layers": 0, "MLPs": 0}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        n = module.weight.numel()
        if ".linear_attn." in name:
            counted["linear-attention layers"] += n
        elif ".self_attn." in name:
            counted["full-attention layers"] += n
        elif ".mlp." in name:
            counted["MLPs"] += n
    counted["LM head"] = model.lm_head.weight.numel()
    assert hybrid_common.decoder_weight_params(t) == counted


def test_state_and_kv_bytes_match_the_model_shapes(tiny):
    t, model = tiny
    state = kv = 0
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            gdn = layer.linear_attn
            conv = gdn.conv1d.weight.shape[0] * (gdn.conv_kernel_size - 1)
            state += conv + gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim
        else:
            attn = layer.self_attn
            kv += 2 * attn.k_proj.weight.shape[0]  # K and V: kv heads x head dim each
    assert state > 0 and kv > 0
    assert hybrid_common.state_bytes_per_sequence(t) == 4 * state
    assert hybrid_common.kv_bytes_per_token(t, 2) == 2 * kv
    step = hybrid_common.decode_step_bytes(t, 2, 2, context=100)
    assert step == {"weights": 2 * sum(hybrid_common.decoder_weight_params(t).values()),
                    "state": 4 * state, "KV": 100 * 2 * kv}


@pytest.mark.parametrize("shape", ["qwen3.5-0.8b", "qwen3.5-2b"])
def test_published_shapes_build(shape):
    """The real shapes are valid Qwen3.5 configs: 24 layers, every fourth full attention."""
    config = hybrid_common.qwen3_5_config(shape)
    t = config.text_config
    assert t.layer_types.count("full_attention") == 6 and len(t.layer_types) == 24
    assert t.layer_types[3::4] == ["full_attention"] * 6
    assert config.vision_config.out_hidden_size == t.hidden_size
