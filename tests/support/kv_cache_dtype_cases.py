"""Builders and constants of tests/ops/reference/test_kv_cache_dtype.py that other test modules use
too (STEP_TOLERANCE, TOLERANCE, path_logits, reference_logits, relative_gap,
scheduling_path_gaps): imported from here by every one of them, that module included."""
import torch
from engine_checks import assert_block_pool_empty
from text_parity_cases import PROMPTS, prompts_of_lengths
from vlinfer import LLM, SamplingParams
from vlinfer.engine import SchedulerOutput

# The stated tolerance (README, correctness): the largest |our logit - transformers' logit| along a
# sequence, as a share of transformers' largest |logit| there, float32 model and weights. fp8 runs
# with scale 1.0 (no checkpoint scales): e4m3 keeps 3 mantissa bits, e5m2 2.
TOLERANCE = {
    "bfloat16": 2e-2, "float16": 3e-3, "int8": 3e-2, "fp8": 0.15, "fp8_e4m3": 0.15, "fp8_e5m2": 0.3
}
# The same measure over the sampled steps only (the prefill's last position, then each decode
# step) of a greedy run through chunked prefill, prefix hits or preemption, 24 tokens after prompts
# of 1-60 tokens: measured 4.7e-3 (bf16), 1.1e-2 (int8), 7.8e-2 (fp8 scale 1.0), 7.1e-2 (fp8 with
# calibrated checkpoint scales) on tiny Qwen3; the fp8 reader dropping the last key: 0.15-1.4.
STEP_TOLERANCE = {"bfloat16": 1e-2, "int8": 2e-2, "fp8": 0.1}


def reference_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def relative_gap(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def path_logits(llm, token_lists):
    """Our logits at every position of each token list, in one packed forward."""
    engine = llm.engine
    seqs = [engine.make_sequence(t, SamplingParams(temperature=0)) for t in token_lists]
    for seq in seqs:
        assert engine.block_manager.allocate(seq, seq.num_tokens)
    logits = engine.model_runner.prompt_logits(SchedulerOutput(seqs, [s.num_tokens for s in seqs]))
    for seq in seqs:
        engine.block_manager.free(seq)
    return torch.split(logits, [len(t) for t in token_lists])


def generate_recording_steps(llm, prompts, params, monkeypatch):
    """llm.generate, and per output the logits each of its tokens was sampled from
    [tokens, vocab]: the run's own steps (chunks, prefix hits, recomputes after a preemption)."""
    import vlinfer.engine.model_runner as model_runner
    sample, steps = model_runner.sample, {}

    def recording(logits, seqs, *args, **kwargs):
        for row, seq in zip(logits, seqs):
            steps.setdefault(seq.request_id, []).append(row.float().clone())
        return sample(logits, seqs, *args, **kwargs)
    monkeypatch.setattr(model_runner, "sample", recording)
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(model_runner, "sample", sample)
    return outs, [torch.stack(steps[o.request_id]) for o in outs]


def step_gaps(model, outs, steps) -> list[float]:
    """Per sequence: the largest |our step logit - transformers' logit at that position of the same
    sequence| as a share of transformers' largest |logit| along it."""
    gaps = []
    for out, ours in zip(outs, steps):
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        start, new = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        assert ours.shape[0] == new  # one sampled step per token, a recompute's included
        ref = reference_logits(model, tokens)
        gaps.append(relative_gap(ours, ref[start - 1:start - 1 + new]) *
                    ref[start - 1:start - 1 + new].abs().max().item() / ref.abs().max().item())
    return gaps


# lengths 1-31, and two sharing a 40-token prefix (prefix-cache hits)
SCHEDULED_PROMPTS = PROMPTS[:5] + [prompts_of_lengths([40], seed=7)[0] + tail
                                   for tail in prompts_of_lengths([3, 20], seed=8)]


def scheduling_path_gaps(path, model, path_kind, monkeypatch, **kv) -> list[float]:
    """Greedy outputs through chunked prefill and prefix-cache hits (the second of two rounds), or
    through preemption and recompute: step_gaps of the run's own steps."""
    if path_kind == "chunked-prefix":
        llm = LLM(path, dtype="float32", kv_cache_bytes=8 << 20, max_num_batched_tokens=16,
                  max_model_len=256, **kv)
        rounds = 2
    else:
        bytes_per_block = LLM(path, dtype="float32", kv_cache_bytes=1 << 20,
                              **kv).engine.model_runner.cache_pool.bytes_per_block
        llm = LLM(path, dtype="float32", kv_cache_bytes=6 * bytes_per_block, max_model_len=96,
                  max_num_batched_tokens=64, **kv)
        rounds = 1
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for round_ in range(rounds):
        outs, steps = generate_recording_steps(llm, SCHEDULED_PROMPTS, params, monkeypatch)
        assert_block_pool_empty(llm)
        if path_kind == "chunked-prefix" and round_ == 1:
            assert all(o.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 16)
    if path_kind == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    return step_gaps(model, outs, steps)
