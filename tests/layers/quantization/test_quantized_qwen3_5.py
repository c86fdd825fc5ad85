"""Quantized Qwen3.5 checkpoints: a tiny random Qwen3.5 (and Qwen3.5-MoE) written as
compressed-tensors W8A8 (dynamic per-token activations) and W4A16 by the compressed-tensors package
(tests/support/quantized_checkpoints.py), the Gated DeltaNet projections (in_proj_qkv / z / b / a,
out_proj) quantized with the rest, and `quantization="int8"` on load; each greedy-decoded by vlinfer
and by transformers running the same dequantized weights (W8A8: the reference linear quantizes its
activations as the op does), float32: tokens identical, as
tests/layers/quantization/test_quantized.py holds every quantized format. conv1d, A_log, dt_bias and
the norms stay dense; a checkpoint that quantizes one of them is refused naming the tensor. Qwen's
block FP8 releases (tests/support/quantized_checkpoints.py write_qwen3_5_fp8, from the format's
definition: in_proj_qkv / z, out_proj, attention, MLP and experts FP8; what the release lists in
modules_to_not_convert dense): prompt logits within 1e-4 per sequence of the dequantized twin,
greedy tokens equal; scales written in the wrong orientation fail. GPTQ / AWQ checkpoints are
refused by name."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantized_checkpoints import LINEAR_SUFFIXES, write_compressed_tensors, write_qwen3_5_fp8
from vlinfer import LLM
from vlinfer.engine import SchedulerOutput
from vlinfer.ops.cpu import quant as cpu_quant
from vlinfer.ops.reference import quant as quant_reference
from vlinfer.toy.tiny_checkpoints import _rescale
from qwen3_5_text_cases import qwen3_5_moe_config, save, text_config
from quantized_cases import (NEW_TOKENS, PROMPT, _methods, _per_token, _reference_tokens,
                             _vlinfer_tokens, greedy_tokens)

LINEAR_ATTN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def dense_checkpoint(folder: str, moe: bool) -> str:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    model_class, config = ((Qwen3_5MoeForCausalLM, qwen3_5_moe_config()) if moe else
                           (Qwen3_5ForCausalLM, text_config()))
    with torch.random.fork_rng(devices=[]):
        model = model_class(config).eval()
    _rescale(model, torch.Generator().manual_seed(4))
    return save(model, folder)


def twin_model(src: str, dequantized: dict, folder: str):
    """transformers on a copy of src holding the dequantized weights (its per-expert tensors
    fused by transformers' own loading), the eager experts."""
    import shutil
    from transformers import AutoModelForCausalLM
    shutil.copytree(src, folder)
    state = load_file(os.path.join(src, "model.safetensors"))
    save_file({**state, **dequantized}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.set_experts_implementation("eager")
    return model


def twin_tokens(src: str, dequantized: dict, activations, folder: str) -> list[int]:
    """transformers' greedy tokens on the dequantized weights (twin_model)."""
    return greedy_tokens(twin_model(src, dequantized, folder), activations)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return dense_checkpoint(str(tmp_path_factory.mktemp("qwen3_5-dense")), moe=False)


def linear_attention_methods(llm) -> set[str]:
    model = llm.engine.model_runner.model
    layers = [m for n, m in model.named_modules() if n.endswith(("linear_attn.in_proj",
                                                                 "linear_attn.out_proj"))]
    assert layers
    return {m.method.describe() if m.method is not None else "dense" for m in layers}


def assert_dense_parts_kept(llm, folder: str) -> None:
    """conv1d, A_log, dt_bias and the gated norm hold the checkpoint's float values."""
    state = load_file(os.path.join(folder, "model.safetensors"))
    la = llm.engine.model_runner.model.model.layers[0].linear_attn
    prefix = "model.layers.0.linear_attn."
    torch.testing.assert_close(la.conv1d.weight.data, state[prefix + "conv1d.weight"][:, 0])
    torch.testing.assert_close(la.A_log.data, state[prefix + "A_log"])
    torch.testing.assert_close(la.dt_bias.data, state[prefix + "dt_bias"])
    assert state[prefix + "conv1d.weight"].dtype == torch.float32


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("scheme", ["w8a8_dynamic", "w4a16"])
def test_compressed_tensors_greedy_matches_transformers(dense, tmp_path, scheme, moe):
    src = dense_checkpoint(str(tmp_path / "moe-dense"), moe=True) if moe else dense
    path = str(tmp_path / scheme)
    # the MoE's down projections (48 and 40 input features) are no whole groups of 32: left dense
    ignore = ("down_proj",) if moe and scheme == "w4a16" else ()
    dequantized, _ = write_compressed_tensors(src, path, scheme, group_size=32, ignore=ignore)
    assert any(".linear_attn.in_proj_b." in name for name in dequantized)
    assert not any(name.endswith(("conv1d.weight_scale", "A_log", "dt_bias"))
                   for name in dequantized)
    activations = None
    if scheme == "w8a8_dynamic" and cpu_quant.has_int8_dot_product():
        # the experts are dequantized on load and run dense (logged): float activations there
        activations = {name[: -len(".weight")]: _per_token for name in dequantized
                       if ".experts." not in name}
    expected = (twin_tokens(src, dequantized, activations, str(tmp_path / "twin")) if moe else
                _reference_tokens(src, dequantized, activations))
    got, llm = _vlinfer_tokens(path)
    assert linear_attention_methods(llm) == _methods(llm) - {"dense"} and \
        "dense" not in linear_attention_methods(llm)
    assert_dense_parts_kept(llm, path)
    llm.close()
    assert got == expected, scheme
    if scheme.startswith("w8a8") and not cpu_quant.has_int8_dot_product():
        pytest.skip("needs AVX512-VNNI, AVX-VNNI or AMX-INT8: W8A8 ran as W8A16 (checked above)")


def test_int8_on_load_matches_transformers_on_the_same_weights(dense):
    from vlinfer.layers.quantization.on_load import quantize_symmetric
    state = load_file(os.path.join(dense, "model.safetensors"))
    dequantized = {
        name: quant_reference.dequantize_weight(*quantize_symmetric(w, 8, None), None)
        for name, w in state.items()
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES}
    assert any(".in_proj_qkv." in name for name in dequantized)
    expected = _reference_tokens(dense, dequantized)
    got, llm = _vlinfer_tokens(dense, quantization="int8")
    assert linear_attention_methods(llm) == {"int8 on load (per channel)"}
    assert_dense_parts_kept(llm, dense)
    llm.close()
    assert got == expected


@pytest.mark.parametrize("edit,match", [
    ("conv_scale", r"'model\.layers\.0\.linear_attn\.conv1d\.weight_scale'.*quantizes "
                   r"model\.layers\.0\.linear_attn\.conv1d .*keeps dense"),
    ("norm_scale", r"'model\.layers\.0\.linear_attn\.norm\.weight_scale'.*keeps dense"),
    ("a_log_int8", r"'model\.layers\.0\.linear_attn\.A_log'.*torch\.int8.*stay dense")])
def test_a_checkpoint_that_quantizes_a_dense_part_is_refused_by_name(dense, tmp_path, edit,
                                                                     match):
    path = str(tmp_path / edit)
    _, _ = write_compressed_tensors(dense, path, "w4a16", group_size=32)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    prefix = "model.layers.0.linear_attn."
    if edit == "conv_scale":
        state[prefix + "conv1d.weight_scale"] = torch.ones(state[prefix + "conv1d.weight"].shape[0])
    elif edit == "norm_scale":
        state[prefix + "norm.weight_scale"] = torch.ones(1)
    else:
        state[prefix + "A_log"] = state[prefix + "A_log"].round().to(torch.int8)
    save_file(state, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "compressed-tensors"
    with pytest.raises(ValueError, match=match):
        LLM(path, dtype="float32", kv_cache_bytes=4 << 20)


def fp8_errors(src: str, tmp_path, transpose_scales: bool = False):
    """(vlinfer, transformers on the dequantized weights) on Qwen's FP8 layout of src in blocks of
    32 (multi-block grids at these sizes): the largest prompt-logit gap over the twin's largest
    logit, both greedy continuations, and vlinfer's linear-attention in_proj method."""
    path = str(tmp_path / "fp8")
    dequantized = write_qwen3_5_fp8(src, path, 32, transpose_scales=transpose_scales)
    assert any(".linear_attn.in_proj_qkv." in n for n in dequantized)
    assert not any(n.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".mlp.gate.weight"))
                   for n in dequantized)
    twin = twin_model(src, dequantized, str(tmp_path / "twin"))
    with torch.no_grad():
        ref = twin(input_ids=torch.tensor([PROMPT])).logits[0]
    got, llm = _vlinfer_tokens(path)
    engine = llm.engine
    seq = engine.make_sequence(PROMPT)
    engine.add_sequence(seq)
    assert engine.block_manager.allocate(seq, seq.num_tokens)
    ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
    engine.abort_request(seq.request_id)
    assert_dense_parts_kept(llm, path)
    in_proj = llm.engine.model_runner.model.model.layers[0].linear_attn.in_proj
    llm.close()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, twin(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    error = ((ours - ref).abs().max() / ref.abs().max()).item()
    return error, got, ids[0, len(PROMPT):].tolist(), in_proj


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen_fp8_release_matches_its_dequantized_twin(dense, tmp_path, moe):
    """in_proj fuses FP8 in_proj_qkv / in_proj_z with the release's dense in_proj_b / in_proj_a:
    one matmul, dequantized on load (their rows scaled by 1)."""
    src = dense_checkpoint(str(tmp_path / "moe-dense"), moe=True) if moe else dense
    error, got, expected, in_proj = fp8_errors(src, tmp_path)
    assert in_proj.method is None  # dequantized after loading: a dense layer
    assert error < 1e-4, error
    assert got == expected


def test_qwen_fp8_scales_in_the_wrong_orientation_fail(tmp_path):
    """The MoE's experts and shared expert (48 / 40 x 64: 2 x 2 blocks of 32) with each scale
    grid transposed: the file opens, and its logits leave the twin's."""
    src = dense_checkpoint(str(tmp_path / "moe-dense"), moe=True)
    error, _, _, _ = fp8_errors(src, tmp_path, transpose_scales=True)
    assert error > 1e-2, error


@pytest.mark.parametrize("method", ["gptq", "awq", "gptq_marlin"])
def test_gptq_and_awq_checkpoints_are_refused_by_name(dense, tmp_path, method):
    import shutil
    path = str(tmp_path / method)
    shutil.copytree(dense, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=rf"quant_method='{method}': GPTQ / AWQ checkpoints are "
                                         r"not read by vlinfer"):
        LLM(path, dtype="float32", kv_cache_bytes=4 << 20)
