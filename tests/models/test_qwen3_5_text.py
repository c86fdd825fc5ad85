"""Qwen3.5 text (Qwen3_5ForCausalLM: Gated DeltaNet layers beside gated full attention) against
transformers, float32, on a tiny random checkpoint: linear key/value head dims 32 / 48 with more
value heads than key heads, full-attention head_dim 64 with partial rotary. Every scheduling path
the state slots meet: a batch of prompts of different lengths, chunked prefill (the state carries
across chunks), a tight KV pool that preempts (the state is dropped and rebuilt), n > 1 and an
abort mid-decode; nothing held after."""
import json
import logging
import os

import pytest
import torch

from engine_checks import assert_block_pool_empty
from vlinfer import LLM, SamplingParams
from vlinfer.engine import SchedulerOutput
from vlinfer.toy.tiny_checkpoints import _rescale
from qwen3_5_text_cases import (LAYER_TYPES, NUM_NEW, PROMPTS, checkpoint, make_llm,
                                qwen3_5_moe_config, qwen3_next_config, save, text_config)

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


def assert_logprobs_match(outs, refs, prompts=True):
    """Every generated token's logprob (decode steps) and, where asked, every prompt token's
    (the prefill chunks) as transformers' within float32 rounding."""
    for out, ref in zip(outs, refs):
        ours = torch.tensor([next(iter(d.values())).logprob if len(d) == 1 else
                             d[t].logprob for d, t in zip(out.outputs[0].logprobs,
                                                          out.outputs[0].token_ids)])
        assert (ours - ref[2]).abs().max().item() < 1e-3
        if prompts and len(ref[3]):
            entries = out.prompt_logprobs[1:]
            prompt = torch.tensor([d[t].logprob for d, t in zip(entries, out.prompt_token_ids[1:])])
            assert (prompt - ref[3]).abs().max().item() < 1e-3


def assert_nothing_held(llm):
    assert_block_pool_empty(llm)
    bm = llm.engine.block_manager
    assert bm.num_free_slots == bm.num_state_slots > 0


def test_prompt_logits_and_batch_match_transformers(checkpoint):
    _, folder, refs = checkpoint
    llm = make_llm(folder)
    engine = llm.engine
    # prefix caching with a checkpoint per live slot (tests/engine/test_hybrid_prefix_cache.py)
    assert engine.resolved.num_state_slots == engine.resolved.num_checkpoint_slots == 8
    assert engine.resolved.enable_prefix_caching
    conv, recurrent = engine.model_runner.cache_pool.state_tensors[0]
    assert conv.dtype == recurrent.dtype == torch.float32  # mamba_ssm_cache_dtype "auto"
    for ids, (ref, *_) in zip(PROMPTS, refs):
        seq = engine.make_sequence(ids)
        engine.add_sequence(seq)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        assert seq.state_slot is not None
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
        engine.abort_request(seq.request_id)
    assert_nothing_held(llm)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]
    assert_nothing_held(llm)


def test_decode_and_prefill_run_the_cpu_kernels(checkpoint, monkeypatch):
    """The engine's linear-attention calls take our kernels (ops/cpu/linear_attention.py), decode
    steps and prefill chunks both, with transformers' tokens."""
    from vlinfer.ops.cpu import linear_attention as cpu_la
    _, folder, refs = checkpoint
    taken = {"delta": [], "conv": [], "decode": []}
    for name, key in (("kernel_takes_delta_rule", "delta"), ("kernel_takes_conv", "conv"),
                      ("is_decode", "decode")):
        rule = getattr(cpu_la, name)
        monkeypatch.setattr(cpu_la, name, lambda *a, rule=rule, key=key:
                            taken[key].append(rule(*a)) or taken[key][-1])
    llm = make_llm(folder)
    assert llm.engine.ops_implementation == "cpu-compiled"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]
    assert taken["delta"] and set(taken["delta"]) == set(taken["conv"]) == {True}
    assert set(taken["decode"]) == {True, False}  # both kernels ran


def test_chunked_prefill_carries_the_state(checkpoint):
    _, folder, refs = checkpoint
    llm = make_llm(folder, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]
    assert_logprobs_match(outs, refs)
    assert_nothing_held(llm)


def test_tight_pool_preempts_and_rebuilds_the_state(checkpoint):
    _, folder, refs = checkpoint
    # 7 blocks of 16 tokens: the four requests cannot all grow at once
    llm = make_llm(folder, kvcache_block_size=16, max_model_len=112, max_num_batched_tokens=128)
    llm_kv = llm.engine.resolved
    assert llm_kv.num_blocks >= 7
    llm = make_llm(folder, kvcache_block_size=16, max_model_len=112, max_num_batched_tokens=128,
                   kv_cache_bytes=7 * llm_kv.bytes_per_block + 8 * llm.engine.model_runner
                   .cache_pool.bytes_per_slot + 1)
    assert llm.engine.resolved.num_blocks == 7
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]
    assert_logprobs_match(outs, refs, prompts=False)
    assert_nothing_held(llm)


def test_n_greater_than_one(checkpoint):
    _, folder, refs = checkpoint
    llm = make_llm(folder)
    outs = llm.generate(PROMPTS[1:3], SamplingParams(n=3, temperature=0, max_tokens=NUM_NEW,
                                                     ignore_eos=True), use_tqdm=False)
    for out, (_, tokens, *_) in zip(outs, refs[1:3]):
        assert [c.token_ids for c in out.outputs] == [tokens] * 3
    assert_nothing_held(llm)


def test_abort_mid_decode_frees_slot_and_blocks(checkpoint):
    """An aborted sequence's slot goes back mid-decode; the next request takes it, stale state and
    all, and starts from zeros (has_state False): its tokens are transformers' still."""
    _, folder, refs = checkpoint
    llm = make_llm(folder)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request(PROMPTS[1], GREEDY, "a")
    engine.add_request(PROMPTS[2], GREEDY, "b")
    for _ in range(4):
        engine.step()
    slot = engine.requests["a"].state_slot
    assert bm.num_free_slots == bm.num_state_slots - 2
    engine.abort_request("a")
    assert bm.num_free_slots == bm.num_state_slots - 1
    engine.add_request(PROMPTS[0], GREEDY, "c")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "c" and engine.requests.get("c") is not None:
                assert engine.requests["c"].state_slot == slot
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert finished == {"b": refs[2][1], "c": refs[0][1]}
    assert_nothing_held(llm)


def edited_checkpoint(tmp_path, overrides: dict) -> str:
    """A tiny Qwen3.5 text checkpoint saved, then its config.json edited by overrides."""
    from transformers import Qwen3_5ForCausalLM
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5ForCausalLM(text_config()).eval()
    folder = save(model, str(tmp_path))
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(overrides)
    json.dump(config, open(path, "w"))
    return folder


@pytest.mark.parametrize("overrides, field", [
    (dict(layer_types=LAYER_TYPES[:5]), "layer_types"),
    (dict(layer_types=LAYER_TYPES[:5] + ["sliding_attention"]), "layer_types"),
])
def test_bad_layer_types_name_the_field(tmp_path, overrides, field):
    folder = edited_checkpoint(tmp_path, overrides)
    with pytest.raises(ValueError, match=field):
        make_llm(folder)


@pytest.mark.parametrize("overrides, field", [
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 is not a multiple of "
                                     "linear_num_key_heads=2"),
    (dict(linear_conv_kernel_dim=1), "linear_conv_kernel_dim=1"),
    (dict(linear_key_head_dim=0), "linear_key_head_dim=0"),
])
def test_linear_sizes_that_do_not_fit_name_the_field(overrides, field):
    from vlinfer.layers.linear_attention import check_linear_config
    check_linear_config(text_config())
    with pytest.raises(ValueError, match=field):
        check_linear_config(text_config(**overrides))


def test_layer_types_checked_by_the_model_too():
    """A config transformers did not validate (hf_overrides, an older config class): the model's
    own check names the field."""
    from types import SimpleNamespace
    from vlinfer.models.qwen3_5 import check_layer_types
    with pytest.raises(ValueError, match="layer_types has 5 entries, num_hidden_layers=6"):
        check_layer_types(SimpleNamespace(layer_types=LAYER_TYPES[:5], num_hidden_layers=6))
    with pytest.raises(ValueError, match="layer_types has None entries"):
        check_layer_types(SimpleNamespace(num_hidden_layers=6))
    assert check_layer_types(SimpleNamespace(layer_types=LAYER_TYPES,
                                             num_hidden_layers=6)) == LAYER_TYPES


def test_bfloat16_as_close_to_float32_as_transformers_bf16(checkpoint):
    """bf16 weights and activations, states kept float32: prompt logits as far from transformers'
    float32 ones as transformers' own bf16 run is, within a factor (bf16 rounding through six
    layers of O(1) activations is large either way); a batch generates."""
    import copy
    model, folder, refs = checkpoint
    hf_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    llm = LLM(folder, dtype="bfloat16", kv_cache_bytes=16 * 2 ** 20, max_model_len=256,
              max_num_seqs=8)
    engine = llm.engine
    for ids, (ref, *_) in zip(PROMPTS, refs):
        with torch.no_grad():
            theirs = hf_bf16(input_ids=torch.tensor([ids])).logits[0].float()
        seq = engine.make_sequence(ids)
        engine.add_sequence(seq)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens])).float()
        engine.abort_request(seq.request_id)
        error = ((ours - ref).abs().max() / ref.abs().max()).item()
        their_error = ((theirs - ref).abs().max() / ref.abs().max()).item()
        assert error < 2 * their_error + 1e-2, (len(ids), error, their_error)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NUM_NEW for o in outs)
    assert_nothing_held(llm)


def test_qwen3_next_matches_transformers(tmp_path):
    """Qwen3-Next: the same layers, its grouped in_proj_qkvz / in_proj_ba reordered on load, a
    dense layer beside sparse ones with a gated shared expert; prompt logits, a batch and a
    chunked run against transformers."""
    from transformers import Qwen3NextForCausalLM
    with torch.random.fork_rng(devices=[]):
        model = Qwen3NextForCausalLM(qwen3_next_config()).eval()
    assert_moe_matches_transformers(model, tmp_path, seed=1)


def test_qwen3_5_moe_matches_transformers(tmp_path):
    """Qwen3.5-MoE: Qwen3.5's layers with routed experts plus a gated shared expert on every
    layer; prompt logits, a batch and a chunked run against transformers."""
    from transformers import Qwen3_5MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5MoeForCausalLM(qwen3_5_moe_config()).eval()
    assert_moe_matches_transformers(model, tmp_path, seed=2)


def assert_moe_matches_transformers(model, tmp_path, seed: int):
    _rescale(model, torch.Generator().manual_seed(seed))
    model.set_experts_implementation("eager")
    folder = save(model, str(tmp_path))
    model.generation_config.eos_token_id = None  # as ignore_eos
    expected = []
    llm = make_llm(folder)
    engine = llm.engine
    for ids in PROMPTS:
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0]
            out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
        seq = engine.make_sequence(ids)
        engine.add_sequence(seq)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        engine.abort_request(seq.request_id)
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_nothing_held(llm)
    chunked = make_llm(folder, max_num_batched_tokens=16)
    outs = chunked.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_nothing_held(chunked)


# The largest |logprob gap| to transformers' float32, per sequence, with the recurrent state stored
# in bfloat16 (float32 weights, chunked prefill, every decode step rounding the state):
# docs/hybrid.md states it with the measured value.
BF16_STATE_TOLERANCE = 6e-2


def test_bfloat16_state_within_its_tolerance(checkpoint):
    """mamba_ssm_cache_dtype="bfloat16" on float32 weights: the recurrent state stored in bf16
    (the conv state keeps the compute dtype), computed in float32 by the reference (which the CPU
    table runs for it: its kernel takes a float32 state only). Chunks of 16
    tokens carry the rounded state across chunks; each sequence's prompt and generated tokens'
    logprobs stay within BF16_STATE_TOLERANCE of transformers' float32, greedy tokens equal."""
    _, folder, refs = checkpoint
    llm = make_llm(folder, mamba_ssm_cache_dtype="bfloat16", max_num_batched_tokens=16,
                   ops="reference")
    conv, recurrent = llm.engine.model_runner.cache_pool.state_tensors[0]
    assert conv.dtype == torch.float32 and recurrent.dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in refs]
    gaps = []
    for out, ref in zip(outs, refs):
        ours = torch.tensor([d[t].logprob for d, t in zip(out.outputs[0].logprobs,
                                                           out.outputs[0].token_ids)])
        gap = (ours - ref[2]).abs().max().item()
        if len(ref[3]):
            prompt = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:],
                                                                out.prompt_token_ids[1:])])
            gap = max(gap, (prompt - ref[3]).abs().max().item())
        gaps.append(gap)
    print(f"bf16 state: largest logprob gap per sequence {[f'{g:.2e}' for g in gaps]}")
    assert max(gaps) < BF16_STATE_TOLERANCE and max(gaps) > 0  # rounded, not float32 unseen
    assert_nothing_held(llm)


def test_bfloat16_state_holds_more_sequences(checkpoint, caplog):
    """The same budget holds the slots its bytes allow: 4 linear layers of a float32 conv state
    (320 channels x 3) and a recurrent state (4 x 32 x 48) in float32 or bf16, beside one
    sequence's KV blocks; the startup log names the count and both dtypes."""
    _, folder, _ = checkpoint
    budget, slots = 4 * 2 ** 20, {}
    for name, dtype, element in (("auto", "float32", 4), ("bfloat16", "bfloat16", 2)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vlinfer"):
            llm = make_llm(folder, mamba_ssm_cache_dtype=name, kv_cache_bytes=budget,
                           max_num_seqs=256, ops="reference")
        resolved = llm.engine.resolved
        one_seq = 256 // resolved.block_size * resolved.bytes_per_block
        slot_bytes = 4 * (320 * 3 * 4 + 4 * 32 * 48 * element)
        assert resolved.num_state_slots == (budget - one_seq) // slot_bytes
        assert f"state cache: {resolved.num_state_slots} state slots in float32/{dtype}" in \
            caplog.text
        slots[name] = resolved.num_state_slots
    # the recurrent state's bytes halve; the conv state's (float32 here) stay
    assert slots["bfloat16"] > 1.7 * slots["auto"]


@pytest.mark.parametrize("kv_name,kv_dtype", [("int8", torch.int8),
                                              ("fp8", torch.float8_e4m3fn)])
def test_startup_log_names_both_capacities(checkpoint, caplog, kv_name, kv_dtype):
    """A compressed KV cache on the full-attention layers beside a bf16 recurrent state: the
    startup log names each cache's count and dtypes, the counts the engine holds, each from its
    own bytes (KV: 2 full-attention layers x 1 KV head x 64 values a row, int8 rows with their
    float32 scale; state: the float32 conv state and the bf16 recurrent state of 4 linear
    layers); the engine still answers."""
    from vlinfer.platform import holds_dtype
    if not holds_dtype(torch.bfloat16, torch.device("cpu")):
        pytest.skip("a bf16 state needs AVX512-BF16 or AMX on this CPU")
    _, folder, expected = checkpoint
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = make_llm(folder, kv_cache_dtype=kv_name, mamba_ssm_cache_dtype="bfloat16",
                       kv_cache_bytes=4 * 2 ** 20)
    resolved = llm.engine.resolved
    row = 64 * kv_dtype.itemsize + (4 if kv_dtype == torch.int8 else 0)
    assert resolved.bytes_per_block == resolved.block_size * 2 * 2 * 1 * row
    slot_bytes = 4 * (320 * 3 * 4 + 4 * 32 * 48 * 2)
    assert llm.engine.model_runner.cache_pool.bytes_per_slot == slot_bytes
    name = str(kv_dtype).removeprefix("torch.")
    assert (f"KV cache: {resolved.num_blocks} blocks of {resolved.block_size} tokens in {name} "
            f"({resolved.num_blocks * resolved.bytes_per_block / 2 ** 20:.1f} MiB") in caplog.text
    assert (f"state cache: {resolved.num_state_slots} state slots in float32/bfloat16 "
            f"({resolved.num_state_slots * slot_bytes / 2 ** 20:.1f} MiB") in caplog.text
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4,
                                                    ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_nothing_held(llm)


def test_a_state_dtype_the_device_cannot_hold_names_the_field(checkpoint, monkeypatch):
    from vlinfer.platform import cpu_features
    _, folder, _ = checkpoint
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype='fp8' is not supported"):
        make_llm(folder, mamba_ssm_cache_dtype="fp8")
    # an AVX2-only CPU: no native bf16 or fp16 (the reference ops: no kernel build for the mock)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    for name in ("float16", "bfloat16"):
        with pytest.raises(ValueError, match=f"mamba_ssm_cache_dtype={name}: this cpu device "
                                             f"has no native {name}"):
            make_llm(folder, mamba_ssm_cache_dtype=name, ops="reference")
    make_llm(folder, mamba_ssm_cache_dtype="float32", ops="reference")


@pytest.mark.parametrize("overrides, field", [
    (dict(linear_conv_kernel_dim=3), "linear_conv_kernel_dim=3"),
    (dict(linear_key_head_dim=16), "linear_key_head_dim"),
    (dict(linear_value_head_dim=40), "linear_value_head_dim"),
    (dict(linear_num_value_heads=2), "linear_num_value_heads=2"),
    (dict(layer_types=["linear_attention"] * 6), "no full_attention entry"),
])
def test_a_config_that_disagrees_with_its_weights_names_the_field(tmp_path, overrides, field):
    """config.json edited after saving: the checkpoint's conv kernel, head dims or value heads no
    longer fit the config, or no layer is full attention; the error at load names the field."""
    folder = edited_checkpoint(tmp_path, overrides)
    with pytest.raises(ValueError, match=field):
        make_llm(folder, ops="reference")


def test_a_pool_without_room_for_one_state_names_the_budget(checkpoint):
    _, folder, _ = checkpoint
    llm = make_llm(folder, ops="reference")
    one_seq = 256 // llm.engine.resolved.block_size * llm.engine.resolved.bytes_per_block
    with pytest.raises(ValueError, match="cannot hold one sequence's state .* raise "
                                         "kv_cache_bytes"):
        make_llm(folder, ops="reference", kv_cache_bytes=one_seq + 1000)
