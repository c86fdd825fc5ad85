"""llama.cpp's `qwen35` GGUF files: a tiny random Qwen3.5 written with gguf-py as llama.cpp's
converter writes it (tests/support/gguf_checkpoints.py: value heads tiled, ssm_a = -exp(A_log),
norms stored as 1 + weight, 2-D weights in Q8_0 / Q4_0 blocks), opened by vlinfer (the config from
the header, the conversion undone, the row-reordered weights kept in their blocks) and held to its
dequantized transformers twin: the same Qwen3_5ForCausalLM with each block-stored weight as gguf-py
dequantizes it and every block-kept linear fed the GGUF op's quantized activations, as
tests/ops/cpu/test_gguf_quantized.py holds the Llama files. float32: prompt logits within
GGUF_TOLERANCE per sequence, greedy tokens identical. qwen35moe files the same way, their stacked
routed experts dequantized (float activations in vlinfer and in the twin), the shared expert kept in
blocks; a file whose experts sit one place off their router fails the same check."""
import os

import pytest
import torch
import torch.nn.functional as F

from engine_checks import assert_block_pool_empty
from gguf_checkpoints import write_tiny_qwen35_gguf
from vlinfer import LLM, SamplingParams
from vlinfer.engine import SchedulerOutput
from vlinfer.ops.reference import gguf as gguf_reference
from vlinfer.toy.tiny_checkpoints import _rescale
from qwen3_5_text_cases import text_config

NUM_NEW = 12
# Per sequence, relative to its largest logit: the op's two-digit activation rounding turns a
# float32 summation-order difference upstream into a different digit now and then (measured up to
# 1.2e-4 over 70 tokens of Q8_0; docs/quantization.md), so not the 1e-4 of dense weights.
GGUF_TOLERANCE = 1e-3
PROMPTS = [[5, 17, 99, 200, 3, 44, 120], list(range(30, 100))]


def tiny_model(seed: int):
    from transformers import Qwen3_5ForCausalLM
    config = text_config(vocab_size=260, num_hidden_layers=4,
                         layer_types=["linear_attention", "full_attention"] * 2,
                         bos_token_id=257, eos_token_id=259, pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5ForCausalLM(config).eval()
    _rescale(model, torch.Generator().manual_seed(seed))
    return model


def twin_of(model, dequantized: dict, dense: set[str]):
    """The model with the file's dequantized weights; every linear whose weight vlinfer keeps in
    blocks (all but `dense`) on the GGUF op's quantized activations."""
    model.load_state_dict(dequantized, strict=False)
    for name, linear in model.named_modules():
        if isinstance(linear, torch.nn.Linear) and name not in dense:
            linear.forward = (lambda lin: lambda x: F.linear(
                gguf_reference.quantize_activations(x).to(x.dtype), lin.weight, lin.bias))(linear)
    model.generation_config.eos_token_id = None  # as ignore_eos
    return model


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_qwen35_gguf_matches_its_dequantized_twin(tmp_path, type_name):
    model = tiny_model(seed=7)
    path, dequantized = write_tiny_qwen35_gguf(model, str(tmp_path / "tiny.gguf"), type_name)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in dequantized
    llm = LLM(path, dtype="float32", kv_cache_bytes=8 * 2 ** 20, max_model_len=256)
    net = llm.engine.model_runner.model
    assert type(net).__name__ == "Qwen3_5ForCausalLM"
    la = net.model.layers[0].linear_attn
    # the fused in_proj (v rows reordered back as block rows) stays in blocks; out_proj, whose
    # columns were reordered inside the blocks, is dequantized
    assert la.in_proj.method is not None and la.out_proj.method is None
    torch.testing.assert_close(la.A_log.data, model.model.layers[0].linear_attn.A_log.data)
    dense = {n for n, m in net.named_modules() if n.endswith("linear_attn.out_proj")}
    twin = twin_of(model, dequantized, dense)
    engine = llm.engine
    for prompt in PROMPTS:
        seq = engine.make_sequence(prompt)
        engine.add_sequence(seq)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        engine.abort_request(seq.request_id)
        with torch.no_grad():
            ref = twin(input_ids=torch.tensor([prompt])).logits[0]
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < GGUF_TOLERANCE
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            expected = twin.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW,
                                     do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
    assert_block_pool_empty(llm)
    assert llm.tokenizer.decode([104, 105]) == "hi"  # the file's own vocabulary


def tiny_moe_model(seed: int):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    base = text_config(vocab_size=260, num_hidden_layers=4,
                       layer_types=["linear_attention", "full_attention"] * 2,
                       bos_token_id=257, eos_token_id=259, pad_token_id=None).to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types",
            "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "rms_norm_eps", "max_position_embeddings",
            "tie_word_embeddings", "rope_parameters", "bos_token_id", "eos_token_id")
    # moe_intermediate_size apart from hidden_size and its half, so the experts' layout is
    # told from its shape (layers/fused_moe.py); every K a multiple of the 32-weight block
    config = Qwen3_5MoeTextConfig(**{k: base[k] for k in keep}, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=96,
                                  shared_expert_intermediate_size=64,
                                  architectures=["Qwen3_5MoeForCausalLM"])
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5MoeForCausalLM(config).eval()
    _rescale(model, torch.Generator().manual_seed(seed))
    model.set_experts_implementation("eager")
    return model


def moe_errors(tmp_path, permute_experts: bool):
    """(vlinfer, the dequantized twin) on a qwen35moe file: per-prompt largest logit gap over
    the twin's largest logit, and whether greedy tokens agree for every prompt."""
    model = tiny_moe_model(seed=11)
    path, dequantized = write_tiny_qwen35_gguf(model, str(tmp_path / "moe.gguf"), "Q8_0",
                                               permute_experts=permute_experts)
    assert dequantized["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 192, 64)
    llm = LLM(path, dtype="float32", kv_cache_bytes=8 * 2 ** 20, max_model_len=256)
    net = llm.engine.model_runner.model
    assert type(net).__name__ == "Qwen3_5MoeForCausalLM"
    mlp = net.model.layers[1].mlp
    # the shared expert stays in its blocks; the router and the shared expert's gate are dense
    assert mlp.shared_expert.gate_up_proj.method is not None
    assert mlp.gate.method is None and mlp.shared_expert_gate.method is None
    dense = {n for n, m in net.named_modules()
             if n.endswith(("linear_attn.out_proj", "mlp.shared_expert_gate"))}
    twin = twin_of(model, dequantized, dense)
    errors = []
    for prompt in PROMPTS:
        seq = llm.engine.make_sequence(prompt)
        llm.engine.add_sequence(seq)
        assert llm.engine.block_manager.allocate(seq, seq.num_tokens)
        ours = llm.engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        llm.engine.abort_request(seq.request_id)
        with torch.no_grad():
            ref = twin(input_ids=torch.tensor([prompt])).logits[0]
        errors.append(((ours - ref).abs().max() / ref.abs().max()).item())
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    same = True
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        with torch.no_grad():
            expected = twin.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW,
                                     do_sample=False)[0, len(prompt):].tolist()
        same = same and out.outputs[0].token_ids == expected
    assert_block_pool_empty(llm)
    return errors, same


def test_qwen35moe_gguf_matches_its_dequantized_twin(tmp_path):
    errors, same = moe_errors(tmp_path, permute_experts=False)
    assert max(errors) < GGUF_TOLERANCE, errors
    assert same


def test_qwen35moe_gguf_with_experts_off_their_router_fails(tmp_path):
    errors, _ = moe_errors(tmp_path, permute_experts=True)
    # the check above fails, with a margin: measured 3.4e-3 and 1.2e-2 on the two prompts
    assert max(errors) > 3 * GGUF_TOLERANCE, errors
