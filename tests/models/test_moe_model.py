"""Qwen3-MoE and Qwen3-VL-MoE against transformers (experts_implementation="eager"), float32, in
each checkpoint layout of the experts: one tensor per expert (Qwen3-MoE hub, transformers'
save_pretrained for Qwen3-MoE), fused 3-D tensors in transformers' in-memory layout (its
save_pretrained for Qwen3-VL-MoE) and in the Qwen3-VL-MoE hub's transposed layout. Tiny random
models: hidden 64, expert width 48 (neither 64 nor 32, so every fused shape tells its layout), 6
experts, top-2; Qwen3-MoE with a dense layer (mlp_only_layers). Then tensor parallel (gloo, 2
ranks), experts sharded and expert parallel, against one rank."""
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine_checks import assert_block_pool_empty

from vlinfer import LLM, SamplingParams, platform
from vlinfer.platform import cpu_features
from vlinfer.engine import SchedulerOutput
from vlinfer.layers import ModelContext
from vlinfer.layers.fused_moe import FusedMoE
from vlinfer.ops import ReferenceOps
from vlinfer.toy.tiny_checkpoints import _rescale
from moe_model_cases import (EXPERT_WIDTH, HIDDEN, IMG_A, IMG_B, IMG_C, NUM_EXPERTS, PROMPT_TWO,
                             TOP_K, hf_inputs, qwen3_moe_config, qwen3_vl_moe_config,
                             save_with_layout)

NUM_NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
LAYOUTS = ("per-expert", "fused", "hub-transposed")
PROMPT_IMG = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image." \
             "<|im_end|>\n<|im_start|>assistant\n"
PROMPT_TEXT = "<|im_start|>user\nWrite one word about the sea.<|im_end|>\n<|im_start|>assistant\n"
VL_CASES = [(PROMPT_IMG, [IMG_A]), (PROMPT_TEXT, []), (PROMPT_TWO, [IMG_B, IMG_C])]
TEXT_PROMPTS = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (5, 61)]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """kind -> (transformers model running its eager experts, {layout: checkpoint folder})."""
    from transformers import Qwen3MoeForCausalLM, Qwen3VLMoeForConditionalGeneration
    built = {}
    for kind, cls, config in (("qwen3-moe", Qwen3MoeForCausalLM, qwen3_moe_config()),
                              ("qwen3-vl-moe", Qwen3VLMoeForConditionalGeneration,
                               qwen3_vl_moe_config())):
        with torch.random.fork_rng(devices=[]):
            model = cls(config).eval()
        _rescale(model, torch.Generator().manual_seed(0))
        model.set_experts_implementation("eager")
        assert model.config._experts_implementation == "eager"
        folders = {
            layout: save_with_layout(model, str(tmp_path_factory.mktemp(f"{kind}-{layout}")),
                                     layout)
            for layout in LAYOUTS
        }
        built[kind] = model, folders
    return built


def make_llm(path, **kw):
    kw.setdefault("kv_cache_bytes", 16 * 2 ** 20)
    kw.setdefault("max_model_len", 1024)
    return LLM(path, dtype="float32", **kw)


def requests(kind):
    if kind == "qwen3-moe":
        return TEXT_PROMPTS
    return [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in VL_CASES]


@pytest.fixture(scope="module")
def references(moe_models):
    """kind -> [(HF input ids, HF kwargs, HF prompt logits, HF greedy tokens)] per request."""
    refs = {}
    for kind, (model, folders) in moe_models.items():
        cases = []
        for i, req in enumerate(requests(kind)):
            if kind == "qwen3-moe":
                ids, kwargs = torch.tensor([req]), {}
            else:
                ids, kwargs = hf_inputs(folders["fused"], *VL_CASES[i])
            with torch.no_grad():
                logits = model(input_ids=ids, **kwargs).logits[0]
                out = model.generate(ids, max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                                     do_sample=False, **kwargs)
            cases.append((ids[0].tolist(), logits, out[0, ids.shape[1]:].tolist()))
        refs[kind] = cases
    return refs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-vl-moe"])
def test_logits_and_mixed_batch_match_transformers(moe_models, references, kind, layout):
    llm = make_llm(moe_models[kind][1][layout])
    engine = llm.engine
    for req, (ids, ref, _) in zip(requests(kind), references[kind]):
        seq = engine.make_sequence(req)
        engine.add_sequence(seq)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        assert seq.token_ids == ids
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
        engine.abort_request(seq.request_id)
    # All requests at once (text and images mixed for Qwen3-VL-MoE): 32 greedy tokens each, as
    # transformers.
    outs = llm.generate(requests(kind), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[2] for r in references[kind]]
    assert_block_pool_empty(llm)


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-vl-moe"])
def test_chunked_prefill_prefix_cache_and_preemption(moe_models, references, kind):
    path = moe_models[kind][1]["hub-transposed"]
    expected = [r[2] for r in references[kind]]
    chunked = make_llm(path, max_num_batched_tokens=16)
    assert [
        o.outputs[0].token_ids for o in chunked.generate(requests(kind), GREEDY, use_tqdm=False)
    ] == expected
    # its prompt is cached now
    again = chunked.generate([requests(kind)[-1]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == expected[-1]
    assert_block_pool_empty(chunked)
    per_block = chunked.engine.model_runner.cache_pool.bytes_per_block
    longest = max(chunked.engine.make_sequence(r).num_tokens for r in requests(kind)) + NUM_NEW
    # room for the longest request and a little more: the others preempt
    blocks = (longest + 15) // 16 + 1
    tight = make_llm(path, kv_cache_bytes=blocks * per_block, max_model_len=blocks * 16,
                     max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids
            for o in tight.generate(requests(kind), GREEDY, use_tqdm=False)] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert_block_pool_empty(tight)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "bfloat16"])
@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-vl-moe"])
def test_compressed_kv_cache_within_its_tolerance(moe_models, references, kind, kv_cache_dtype):
    """A KV cache in int8 / bf16 (image tokens in it for Qwen3-VL-MoE): prompt logits within the
    tolerance tests/ops/reference/test_kv_cache_dtype.py states, under chunked prefill."""
    from kv_cache_dtype_cases import TOLERANCE
    llm = make_llm(moe_models[kind][1]["fused"], kv_cache_dtype=kv_cache_dtype,
                   max_num_batched_tokens=16)
    engine = llm.engine
    for req, (ids, ref, _) in zip(requests(kind), references[kind]):
        seq = engine.make_sequence(req)
        engine.add_sequence(seq)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[kv_cache_dtype]
        engine.abort_request(seq.request_id)
    outs = llm.generate(requests(kind), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NUM_NEW for o in outs)
    assert_block_pool_empty(llm)


# ---- loading errors ----

def small_moe(hidden=HIDDEN, width=EXPERT_WIDTH):
    return FusedMoE(ModelContext(ReferenceOps()), hidden, width, NUM_EXPERTS, TOP_K,
                    renormalize=True)


def test_fused_layout_is_decided_by_shape_or_refused():
    layer = small_moe()
    gate_up = torch.randn(NUM_EXPERTS, 2 * EXPERT_WIDTH, HIDDEN)
    layer.load_fused("gate_up", gate_up.transpose(1, 2))  # the hub's transposed layout
    assert torch.equal(layer.w13_weight, gate_up)
    layer.load_fused("gate_up", gate_up)  # transformers' layout
    assert torch.equal(layer.w13_weight, gate_up)
    with pytest.raises(ValueError,
                       match=r"has shape \(6, 96, 63\).*expects \(6, 96, 64\).*or \(6, 64, 96\)"):
        layer.load_fused("gate_up", torch.randn(NUM_EXPERTS, 96, 63))
    with pytest.raises(ValueError, match="expert 1 down_proj has shape"):
        layer.load_expert(1, "down", torch.randn(EXPERT_WIDTH, HIDDEN))
    with pytest.raises(ValueError, match="outside the model's num_experts=6"):
        layer.load_expert(6, "gate", torch.randn(EXPERT_WIDTH, HIDDEN))
    assert layer.missing_experts() == [f"expert {e} down_proj" for e in range(NUM_EXPERTS)]
    # hidden == 2 * width: both layouts of gate_up are [6, 64, 64]
    square = small_moe(hidden=64, width=32)
    with pytest.raises(ValueError, match="cannot be told apart"):
        square.load_fused("gate_up", torch.randn(NUM_EXPERTS, 64, 64))


def test_missing_expert_is_an_error(moe_models, tmp_path):
    src = moe_models["qwen3-moe"][1]["per-expert"]
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    file = os.path.join(tmp_path, "model.safetensors")
    with safe_open(file, "pt") as f:
        tensors = {
            n: f.get_tensor(n)
            for n in f.keys() if n != "model.layers.2.mlp.experts.4.up_proj.weight"
        }
    save_file(tensors, file)
    with pytest.raises(ValueError,
                       match=r"missing expert weights of model\.layers\.2\.mlp: expert 4 up_proj"):
        make_llm(str(tmp_path))


# ---- tensor parallel ----

@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sharded", "expert-parallel"])
def test_tensor_parallel_matches_one_rank(moe_models, references, expert_parallel):
    path = moe_models["qwen3-moe"][1]["per-expert"]
    llm = make_llm(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                   kv_cache_bytes=4 * 2**20)
    try:
        outs = llm.generate(requests("qwen3-moe"), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [r[2] for r in references["qwen3-moe"]]
        ranks = llm.engine.model_runner.describe_all()
        for rank in ranks:
            w13 = rank["params"]["model.layers.0.mlp.w13_weight"][0]
            w2 = rank["params"]["model.layers.0.mlp.w2_weight"][0]
            if expert_parallel:  # whole experts, 3 per rank
                assert w13 == (NUM_EXPERTS // 2, 2 * EXPERT_WIDTH,
                               HIDDEN) and w2 == (NUM_EXPERTS // 2, HIDDEN, EXPERT_WIDTH)
            else:  # every expert, half of its intermediate dimension
                assert w13 == (NUM_EXPERTS, EXPERT_WIDTH, HIDDEN) and w2 == (NUM_EXPERTS, HIDDEN,
                                                                             EXPERT_WIDTH // 2)
        assert_block_pool_empty(llm)
    finally:
        llm.close()


def test_expert_parallel_needs_divisible_experts():
    from vlinfer.distributed import check_tensor_parallel_shapes
    config = qwen3_moe_config()
    check_tensor_parallel_shapes(config, 2, expert_parallel=True)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by it"):
        check_tensor_parallel_shapes(config, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="moe_intermediate_size=48 is not divisible by it"):
        check_tensor_parallel_shapes(config, 32, expert_parallel=False)


# ---- quantized experts ----

@pytest.mark.parametrize("scheme", ["w4a16_asym", "w8a16", "fp8"])
def test_quantized_experts_are_dequantized_on_load_and_match(moe_models, tmp_path, scheme, caplog):
    """A quantized Qwen3-MoE (compressed-tensors or FP8 blocks: every linear layer and every expert
    projection, the router dense as llm-compressor leaves it): the experts are dequantized on load
    (logged, with their count), the other layers run their method; 32 greedy tokens equal
    transformers' on the same dequantized weights. A quantized projection missing one of its tensors
    is named."""
    import logging

    from quantized_checkpoints import write_compressed_tensors, write_fp8_block
    from transformers import Qwen3MoeForCausalLM
    src = moe_models["qwen3-moe"][1]["per-expert"]
    path = str(tmp_path / scheme)
    if scheme == "fp8":
        dequantized, written = write_fp8_block(src, path)
    else:  # groups of 16 divide every input width here (64, 48, 96)
        dequantized, written = write_compressed_tensors(src, path, scheme, group_size=16)
    expert_projections = [n for n in dequantized if ".experts." in n]
    # two sparse layers of 6 experts x gate, up, down
    assert len(expert_projections) == 2 * NUM_EXPERTS * 3
    reference = tmp_path / "reference"
    shutil.copytree(src, reference)
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        dense = {n: f.get_tensor(n) for n in f.keys()}
    save_file({**dense, **dequantized}, os.path.join(reference, "model.safetensors"))
    model = Qwen3MoeForCausalLM.from_pretrained(str(reference), dtype=torch.float32).eval()
    model.set_experts_implementation("eager")
    expected = []
    # plain argmax steps: EOS may come up (generate's min_new_tokens would forbid it)
    for prompt in TEXT_PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(NUM_NEW):
                ids = torch.cat(
                    [ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        expected.append(ids[0, len(prompt):].tolist())
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        llm = make_llm(path)
    assert (f"the MoE experts' {len(expert_projections)} quantized projections are dequantized "
            "on load") in caplog.text
    got = [o.outputs[0].token_ids for o in llm.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)]
    llm.close()
    assert got == expected
    # One expert projection without its scales: loading names it.
    scale = "weight_scale_inv" if scheme == "fp8" else "weight_scale"
    broken = {
        n: t
        for n, t in written.items() if n != f"model.layers.2.mlp.experts.4.up_proj.{scale}"
    }
    save_file({k: v.contiguous()
               for k, v in broken.items()}, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=rf"model\.layers\.2\.mlp\.experts\.4\.up_proj.*{scale}"):
        make_llm(path)


def test_bf16_on_the_cpu_runs_the_expert_kernel_within_bf16_tolerance(moe_models, references,
                                                                      monkeypatch):
    """bfloat16 on the CPU op table, on the path this CPU takes: with expert panels (AVX512-BF16, no
    AMX) every step runs expert_panel_matmul; otherwise a step with at most cpu_moe.SMALL_GROUP_ROWS
    rows per active expert (the 5-token prompt: 10 pairs over 6 experts; every decode step here)
    runs expert_matmul and the 61-token prompt the grouped GEMM. The prompt's logits stay within
    bf16 tolerance of transformers' float32 ones (2e-2 of the largest, the op's bound), and both
    requests then decode to the end."""
    llm = LLM(moe_models["qwen3-moe"][1]["per-expert"], dtype="bfloat16", kv_cache_bytes=16 * 2**20,
              max_model_len=1024)
    ops = llm.engine.model_runner.ctx.ops
    assert ops.name == "cpu-compiled"
    assert ops.moe_panels == (ops.ext.expert_panels_available() and
                              "amx_bf16" not in cpu_features.cpu_flags())
    calls = []
    name = "expert_panel_matmul" if ops.moe_panels else "expert_matmul"
    kernel = getattr(ops.ext, name)
    monkeypatch.setattr(ops.ext, name, lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    engine = llm.engine
    for req, (ids, ref, _) in zip(requests("qwen3-moe"), references["qwen3-moe"]):
        seq = engine.make_sequence(req)
        engine.add_sequence(seq)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        before = len(calls)
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens])).float()
        # TEXT_PROMPTS: 5, 61 tokens
        assert (len(calls) > before) == (ops.moe_panels or len(ids) == 5), len(ids)
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 2e-2
        engine.abort_request(seq.request_id)
    calls.clear()
    outs = llm.generate(requests("qwen3-moe"), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NUM_NEW for o in outs) and calls
    assert_block_pool_empty(llm)
