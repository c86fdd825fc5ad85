"""LoRA adapters made by peft itself (random non-zero B), run by the engine against transformers +
PEFT on the same weights, float32: prompt logits within 1e-4 and greedy tokens equal, per adapter
and mixed in one batch with base requests, through chunked prefill, the prefix cache (keyed by the
adapter) and preemption; bad adapters refused by name while the others run."""
import logging
import os
import re

import pytest
import torch

from engine_checks import assert_block_pool_empty

from text_checkpoints import build_checkpoint, tiny_text_config
from vlinfer import LLM, LoRARequest, SamplingParams
from vlinfer.engine import SchedulerOutput
from vlinfer.outputs import RequestError
from vlinfer.platform import cpu_features
from lora_cases import ALL_LINEARS, make_adapter, peft_model

# name -> (rank, alpha, rslora, targets, seed)
ADAPTERS = {"style": (8, 16, False, ALL_LINEARS, 1), "fields": (4, 8, True, ALL_LINEARS, 2),
            "attn": (16, 8, False, ["q_proj", "v_proj"], 3)}
# Token ids (the tiny checkpoints' vocabulary is 512 wide): a short, a longer and a repetitive
# prompt.
PROMPTS = [(5, 17, 42, 99), (7, 300, 12, 48, 250, 3, 77, 8, 401, 66, 21, 9, 130, 44),
           (11, 12, 11, 12, 11, 12)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=[("qwen3", True), ("llama", False)], ids=["qwen3", "llama"])
def setup(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    family, tie = request.param
    path = str(tmp_path_factory.mktemp(f"lora-{family}"))
    build_checkpoint(path, tiny_text_config(family, tie))
    adapters = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        adapters[name] = LoRARequest(name, i + 1,
                                     make_adapter(base, str(tmp_path_factory.mktemp(name)), *spec))
    return path, adapters


def reference(path, adapter, prompt: tuple) -> tuple[torch.Tensor, list[int]]:
    model = peft_model(path, adapter)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0]
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    return logits, out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def references(setup):
    path, adapters = setup
    return {(name, prompt): reference(path, adapters.get(name), prompt)
            for name in [None, *adapters] for prompt in PROMPTS}


def make_llm(path, **kw):
    options = dict(dtype="float32", kv_cache_bytes=16 * 2**20, max_model_len=256, enable_lora=True,
                   max_loras=2, max_lora_rank=16)
    return LLM(path, **{**options, **kw})


def prompt_logits(llm, prompt: tuple, lora: LoRARequest | None) -> torch.Tensor:
    engine = llm.engine
    seq = engine.make_sequences(list(prompt), lora_request=lora)[0]
    assert engine.block_manager.allocate(seq, seq.num_tokens)
    try:
        return engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
    finally:
        engine.block_manager.free(seq)


def test_logits_and_greedy_tokens_equal_peft_per_adapter(setup, references, caplog):
    """Where the CPU kernels have float32 panels (AVX-512) the decode steps' updates run the panel
    kernel (cpu/csrc/lora_panels.cpp): the log says how many layers keep packed slots."""
    path, adapters = setup
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = make_llm(path)
    packed = re.search(r"LoRA slots of (\d+) of (\d+) layers also kept in (\S+)'s packed layout",
                       caplog.text)
    assert packed, caplog.text
    has_panels = llm.engine.model_runner.ctx.ops.name == "cpu-compiled" and \
        cpu_features.CPU_ISAS.index(cpu_features.cpu_isa()) >= cpu_features.CPU_ISAS.index("avx512")
    assert (packed[1] == packed[2]) if has_panels else packed[1] == "0", packed[0]
    for name in [None, *adapters]:
        lora = adapters.get(name)
        for prompt in PROMPTS:
            ref_logits, ref_tokens = references[(name, prompt)]
            ours = prompt_logits(llm, prompt, lora)
            scale = ref_logits.abs().max()
            assert (ours - ref_logits).abs().max() / scale < 1e-4, (name, prompt)
        outs = llm.generate([list(p) for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=lora)
        assert [o.outputs[0].token_ids
                for o in outs] == [references[(name, p)][1] for p in PROMPTS], name
    base = references[(None, PROMPTS[0])][1]
    # the adapters change the answers
    assert any(references[(name, PROMPTS[0])][1] != base for name in adapters)
    assert_block_pool_empty(llm)


def test_merged_adapter_gives_the_same_logits(setup):
    """PEFT's merge_and_unload() folds B A into the weights: the engine's unmerged updates equal it
    too."""
    path, adapters = setup
    merged = peft_model(path, adapters["style"]).merge_and_unload()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        ref = merged(ids).logits[0]
    ours = prompt_logits(make_llm(path), PROMPTS[1], adapters["style"])
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4


def test_mixed_batch_equals_each_alone_through_every_scheduling_path(setup, references):
    """Three adapters and the base model interleaved in one call, with two slots (adapters swap in
    and out), 16-token chunks and a pool small enough to preempt: every request gets what it gets
    alone."""
    path, adapters = setup
    names = [None, "style", "fields", "attn"] * 3
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    inputs = [list(p) for p in prompts]
    loras = [adapters.get(n) for n in names]
    for options in (dict(max_num_batched_tokens=16), dict(kv_cache_bytes=24 * 1024,
                                                          max_model_len=32)):
        llm = make_llm(path, **options)
        outs = llm.generate(inputs, GREEDY, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids
                for o in outs] == [references[(n, p)][1] for n, p in zip(names, prompts)]
        assert_block_pool_empty(llm)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_is_keyed_by_the_adapter(setup, references):
    path, adapters = setup
    llm = make_llm(path)
    prompt = list(PROMPTS[1]) * 3  # several full blocks
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["style"])[0]
    same = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["style"])[0]
    other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["fields"])[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert same.num_cached_tokens > 0 and same.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def test_bad_adapters_are_refused_by_name_and_the_others_run(setup, tmp_path, references):
    from transformers import AutoModelForCausalLM, LlamaConfig
    path, adapters = setup
    llm = make_llm(path, max_lora_rank=8)
    too_big = adapters["attn"]  # rank 16
    missing = LoRARequest("missing", 10, str(tmp_path / "nowhere"))
    corrupt_dir = tmp_path / "corrupt"
    corrupt_dir.mkdir()
    (corrupt_dir / "adapter_config.json").write_text(
        open(os.path.join(adapters["style"].lora_path, "adapter_config.json")).read())
    (corrupt_dir / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    corrupt = LoRARequest("corrupt", 11, str(corrupt_dir))
    other_base = str(tmp_path / "other-base")
    config = tiny_text_config("llama", False)
    config.hidden_size, config.intermediate_size = 32, 96
    build_checkpoint(other_base, config)
    foreign = LoRARequest(
        "foreign", 12,
        make_adapter(AutoModelForCausalLM.from_pretrained(other_base), str(tmp_path / "foreign"), 4,
                     8, False, ALL_LINEARS, 5))
    head_only = LoRARequest(
        "head", 13,
        make_adapter(AutoModelForCausalLM.from_pretrained(path), str(tmp_path / "head"), 4, 8,
                     False, ["lm_head"], 6))
    from safetensors.torch import load_file, save_file
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "adapter_config.json").write_text((corrupt_dir / "adapter_config.json").read_text())
    tensors = {
        k.replace("self_attn.o_proj", "self_attn.out_proj"): v
        for k, v in load_file(os.path.join(adapters["style"].lora_path,
                                           "adapter_model.safetensors")).items()
    }
    save_file(tensors, str(renamed / "adapter_model.safetensors"))
    unknown = LoRARequest("unknown", 14, str(renamed))  # a module this model does not have
    loras = [adapters["style"], too_big, missing, corrupt, foreign, head_only, None, unknown]
    with pytest.raises(RequestError) as e:
        llm.generate([list(PROMPTS[0])] * len(loras), GREEDY, use_tqdm=False, lora_request=loras)
    outs = e.value.outputs
    assert outs[0].outputs[0].token_ids == references[("style", PROMPTS[0])][1]
    assert outs[6].outputs[0].token_ids == references[(None, PROMPTS[0])][1]
    assert "rank 16 is above max_lora_rank=8" in outs[1].error and "'attn'" in outs[1].error
    assert "no adapter_config.json" in outs[2].error
    assert "cannot be read" in outs[3].error
    assert "another model" in outs[4].error
    # PEFT stores the head's own weight beside its LoRA: refused by name
    assert "lm_head" in outs[5].error
    assert "out_proj" in outs[7].error and "not a linear layer" in outs[7].error
    assert_block_pool_empty(llm)
    off = LLM(path, dtype="float32", kv_cache_bytes=4 * 2 ** 20, max_model_len=128)
    with pytest.raises(RequestError, match="LoRA is off"):
        off.generate(list(PROMPTS[0]), GREEDY, use_tqdm=False, lora_request=adapters["style"])
    with pytest.raises(ValueError, match="positive int"):
        LoRARequest("x", 0, "/tmp")


@pytest.mark.slow  # two processes: `make test-full` and CI run it
def test_tensor_parallel_adapters_equal_peft(setup, references):
    """TP=2: A whole and B split by output rows on column-parallel layers, A split by input columns
    and B whole on row-parallel ones (the update added before the all-reduce); each worker installs
    its shard."""
    path, adapters = setup
    with make_llm(path, tensor_parallel_size=2) as llm:
        names = [None, "style", "fields", "attn"]
        outs = llm.generate([list(PROMPTS[1])] * 4, GREEDY, use_tqdm=False,
                            lora_request=[adapters.get(n) for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [references[(n, PROMPTS[1])][1] for n in names]
