"""msModelSlim checkpoints (vlinfer/layers/quantization/modelslim.py): tiny random Qwen3 and
Qwen3-VL checkpoints written by tests/support/modelslim_checkpoints.py with the format's own rules
(W8A8 static, W8A8_DYNAMIC, W8A16 and FLOAT layers; the Qwen3-VL vision tower partly quantized, as
msModelSlim's Qwen3-VL recipe does).

- CPU, float32, the reference ops: greedy tokens equal transformers running the same dequantized
  weights with the
  same activation quantization (modelslim_checkpoints.apply_reference), token for token.
- The emulated torch_npu (tests/fakes/fake_torch_npu.py), bfloat16: every quantized linear runs
  torch_npu's calls
  (npu_quantize / npu_dynamic_quant + npu_quant_matmul, npu_weight_quant_batchmatmul), the vision
  tower's quantized
  layers included; each generated token is within BF16_LOGIT_TOLERANCE of the reference's best
  logit."""
import copy
import os

import pytest
import torch

from text_checkpoints import hf_qwen3_vl_processor
from fake_torch_npu import fake_npu  # noqa: F401  (fixture)
from images import picture
from modelslim_checkpoints import apply_reference, calibrate, write_modelslim
from vlinfer import LLM, SamplingParams
from vlinfer.layers.quantization import TensorInfo
from vlinfer.layers.quantization.modelslim import ModelSlimLinear, ModelSlimQuantization
from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
from text_parity_cases import BF16_LOGIT_TOLERANCE

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
PROMPTS = [[5, 17, 300, 2, 9], list(range(40, 140)), [7] * 3]
IMAGE_TOKEN = 151655
VL_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image." \
            "<|im_end|>\n<|im_start|>assistant\n"
IMAGE = picture(256, 192, 3)
QUANT_OPS = ("npu_quantize", "npu_dynamic_quant", "npu_quant_matmul",
             "npu_weight_quant_batchmatmul")


def text_types(prefix: str, layers: int) -> dict:
    """Layer 0 static W8A8 (down_proj FLOAT, as msModelSlim's recipes exclude it), layer 1
    W8A8_DYNAMIC attention and W8A16 MLP: every linear type in one checkpoint."""
    types = {}
    for i in range(layers):
        base = f"{prefix}.layers.{i}"
        attn = "W8A8" if i == 0 else "W8A8_DYNAMIC"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            types[f"{base}.self_attn.{name}"] = attn
        for name in ("gate_proj", "up_proj") + (("down_proj",) if i else ()):
            types[f"{base}.mlp.{name}"] = "W8A8" if i == 0 else "W8A16"
    return types


def hf_greedy(model, ids, **inputs):
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=[], max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)
    x = torch.tensor([ids])
    if "pixel_values" in inputs:
        inputs["mm_token_type_ids"] = (x == IMAGE_TOKEN).int()
    with torch.no_grad():
        return model.generate(x, generation_config=config, **inputs)[0, len(ids):].tolist()


def max_logit_gap(model, ids, tokens, **inputs) -> float:
    """How far below the reference's best logit each generated token's logit is (relative to the
    logit scale)."""
    x = torch.tensor([ids + tokens])
    if "pixel_values" in inputs:
        inputs["mm_token_type_ids"] = (x == IMAGE_TOKEN).int()
    with torch.no_grad():
        logits = model(input_ids=x, **inputs).logits[0, len(ids) - 1:-1].float()
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return ((logits.max(-1).values - chosen) / logits.abs().max()).max().item()


def quantized_layers(model) -> dict:
    return {
        name: m.method.kind
        for name, m in model.named_modules()
        if isinstance(getattr(m, "method", None), ModelSlimLinear)
    }


# ---- Qwen3 text ----

@pytest.fixture(scope="module")
def text_checkpoint(qwen3_checkpoint, tmp_path_factory):
    dense, model = qwen3_checkpoint
    ranges = calibrate(model, lambda m: [m(torch.tensor([p])) for p in PROMPTS])
    folder = str(tmp_path_factory.mktemp("modelslim-qwen3"))
    reference = write_modelslim(dense, folder, text_types("model", 2), ranges)
    ref_model = copy.deepcopy(model)  # the session's model: left as it is
    apply_reference(ref_model, reference)
    return folder, ref_model


def test_text_greedy_equals_transformers_on_the_dequantized_weights(text_checkpoint, monkeypatch):
    folder, ref_model = text_checkpoint
    monkeypatch.setenv("VLINFER_OPS", "reference")
    llm = LLM(folder, dtype="float32", kv_cache_bytes=4 * 2 ** 20)
    kinds = quantized_layers(llm.engine.model_runner.model)
    assert sorted(set(kinds.values())) == ["W8A16", "W8A8", "W8A8_DYNAMIC"]
    assert "model.layers.0.mlp.down_proj" not in kinds  # FLOAT stays dense
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref_model, p) for p in PROMPTS]


def test_text_on_the_emulated_npu(text_checkpoint, fake_npu):  # noqa: F811
    folder, ref_model = text_checkpoint
    llm = LLM(folder, dtype="bfloat16", kvcache_block_size=128, kv_cache_bytes=8 * 2 ** 20)
    assert llm.engine.ops_implementation == "npu"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for op in QUANT_OPS:
        assert fake_npu.calls[op] > 0, op
    for p, out in zip(PROMPTS, outs):
        assert max_logit_gap(ref_model, p, out.outputs[0].token_ids) <= BF16_LOGIT_TOLERANCE


def test_bad_descriptions_are_refused_naming_the_tensor(text_checkpoint, tmp_path):
    import json
    import shutil
    folder = str(tmp_path / "bad")
    shutil.copytree(text_checkpoint[0], folder)
    path = os.path.join(folder, "quant_model_description.json")
    with open(path) as f:
        description = json.load(f)
    key = "model.layers.1.self_attn.o_proj.weight"
    with open(path, "w") as f:
        json.dump({**description, key: "W4A8_DYNAMIC"}, f)
    # before any KV memory
    with pytest.raises(ValueError, match="type 'W4A8_DYNAMIC' is not supported") as e:
        LLM(folder, dtype="float32", kv_cache_bytes=2 ** 20)
    assert key in str(e.value)
    # The same rules without an engine: an int8 tensor marked FLOAT, a missing scale, a KV cache or
    # attention quantization other than C8 (tests/layers/quantization/test_kv_cache_schemes.py opens
    # C8).
    quant = ModelSlimQuantization({**description, key: "FLOAT"})
    int8 = {key: TensorInfo((64, 64), "I8")}
    with pytest.raises(ValueError, match="integer tensor .* marks it FLOAT"):
        quant.method_for(None, key[:-len(".weight")], int8)
    with pytest.raises(ValueError,
                       match=r"missing tensors \['model.layers.1.self_attn.o_proj.weight_scale'"):
        ModelSlimQuantization(description).method_for(None, key[:-len(".weight")], int8)
    with pytest.raises(ValueError, match="kv_cache_type='C4'"):
        ModelSlimQuantization({**description, "kv_cache_type": "C4"})
    with pytest.raises(ValueError, match="fa_quant_type='FAQuant'"):
        ModelSlimQuantization({**description, "fa_quant_type": "FAQuant"})
    ModelSlimQuantization({**description, "kv_cache_type": "C8"})
    with pytest.raises(ValueError, match="lm_head.weight is W8A8"):
        ModelSlimQuantization({**description, "lm_head.weight": "W8A8"})


# ---- Qwen3-VL, vision tower partly quantized ----

def vl_types(depth: int) -> dict:
    """msModelSlim's Qwen3-VL recipe: W8A8 everywhere except *linear_fc2, *merger* and the text
    down_proj."""
    types = {}
    for i in range(depth):
        for name in ("attn.qkv", "attn.proj", "mlp.linear_fc1"):
            types[f"model.visual.blocks.{i}.{name}"] = "W8A8"
    types.update(text_types("model.language_model", 2))
    return types


def hf_vl_inputs(folder, text, images):
    out = hf_qwen3_vl_processor(folder)(text=[text], images=images, return_tensors="pt")
    return out["input_ids"][0].tolist(), {
        "pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]
    }


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    from transformers import Qwen3VLForConditionalGeneration
    dense = build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("modelslim-vl-dense")), seed=0,
                                num_heads=4, num_kv_heads=2, head_dim=32, mrope_section=(6, 5, 5),
                                vision_depth=2, deepstack_visual_indexes=[0, 1],
                                tie_word_embeddings=False)
    model = Qwen3VLForConditionalGeneration.from_pretrained(dense, dtype=torch.float32).eval()
    ids, inputs = hf_vl_inputs(dense, VL_PROMPT, [IMAGE])
    x = torch.tensor([ids])
    ranges = calibrate(
        model, lambda m: m(input_ids=x, mm_token_type_ids=(x == IMAGE_TOKEN).int(), **inputs))
    folder = str(tmp_path_factory.mktemp("modelslim-vl"))
    reference = write_modelslim(dense, folder, vl_types(2), ranges)
    apply_reference(model, reference)
    return folder, model


def test_qwen3_vl_greedy_equals_transformers(vl_checkpoint, monkeypatch):
    folder, ref_model = vl_checkpoint
    monkeypatch.setenv("VLINFER_OPS", "reference")
    llm = LLM(folder, dtype="float32", kv_cache_bytes=8 * 2 ** 20, max_model_len=512)
    kinds = quantized_layers(llm.engine.model_runner.model)
    assert kinds["model.visual.blocks.1.attn.qkv"] == "W8A8"
    assert not any("linear_fc2" in name or "merger" in name for name in kinds)
    out = llm.generate([{"prompt": VL_PROMPT, "multi_modal_data": {"image": IMAGE}}], GREEDY,
                       use_tqdm=False)
    ids, inputs = hf_vl_inputs(folder, VL_PROMPT, [IMAGE])
    assert out[0].outputs[0].token_ids == hf_greedy(ref_model, ids, **inputs)


def test_qwen3_vl_on_the_emulated_npu(vl_checkpoint, fake_npu):  # noqa: F811
    folder, ref_model = vl_checkpoint
    llm = LLM(folder, dtype="bfloat16", kvcache_block_size=128, kv_cache_bytes=16 * 2**20,
              max_model_len=512)
    model = llm.engine.model_runner.model
    ids, inputs = hf_vl_inputs(folder, VL_PROMPT, [IMAGE])
    # The vision tower alone: its three quantized linears per block run torch_npu's static W8A8
    # calls.
    before = dict(fake_npu.calls)
    model.encode_images(inputs["pixel_values"].to(torch.bfloat16), inputs["image_grid_thw"])
    assert fake_npu.calls["npu_quantize"] - before.get("npu_quantize", 0) == 3 * 2
    assert fake_npu.calls["npu_quant_matmul"] - before.get("npu_quant_matmul", 0) == 3 * 2
    out = llm.generate([{"prompt": VL_PROMPT, "multi_modal_data": {"image": IMAGE}}], GREEDY,
                       use_tqdm=False)
    for op in QUANT_OPS:
        assert fake_npu.calls[op] > 0, op
    assert max_logit_gap(ref_model, ids, out[0].outputs[0].token_ids,
                         **inputs) <= BF16_LOGIT_TOLERANCE
