"""Speculative decoding (speculative_config; vlinfer/engine/speculative/, the verification in
engine/sampler.py): greedy outputs token for token those of the engine without it, on every
scheduling path and for both proposers; sampled outputs distributed as without it; the KV pool and
the draft's pool empty after every run, aborts in between included; streams that only ever show
accepted tokens; the adaptive rule and the metrics."""
import numpy as np
import pytest
import torch

from engine_checks import assert_block_pool_empty

from text_checkpoints import build_checkpoint, tiny_text_config
from vlinfer import LLM, SamplingParams
from vlinfer.config import SpeculativeConfig
from vlinfer.engine import sampler
from vlinfer.engine.sequence import Sequence
from vlinfer.engine.speculative import ngram, speculator
from vlinfer.engine.speculative.ngram import propose_ngram

# adaptive off: every step proposes what it can, so the counts below do not depend on timings (the
# adaptive rules have their own tests, and greedy identity is checked with them on too).
NGRAM = {
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
    "adaptive": False
}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Prompts whose continuations repeat what came before (proposals hit) and ones that do not.
PROMPTS = [[5, 6, 7, 8, 9] * 6, [(i * 7 + j * 13) % 500 + 3 for j in range(30) for i in (1,)],
           [11, 12, 13, 11, 12, 13, 40, 41] * 3, [(j * j) % 509 + 3 for j in range(25)]]
OPTIONS = dict(dtype="float32", kv_cache_bytes=16 * 2 ** 20)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny random Qwen3 and Llama of one vocabulary, and a second Qwen3 of another seed (a draft
    that disagrees)."""
    made = {}
    for name, family, seed in (("qwen3", "qwen3", 0), ("llama", "llama", 0), ("other-qwen3",
                                                                              "qwen3", 7)):
        path = str(tmp_path_factory.mktemp(name))
        build_checkpoint(path, tiny_text_config(family, family == "qwen3"), seed=seed)
        made[name] = path
    return made


def outputs(llm, prompts, params):
    return [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]


def assert_pools_empty(llm):
    assert_block_pool_empty(llm)
    draft = llm.engine.speculator.draft
    if draft is not None:
        assert not draft.shadows \
            and draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


@pytest.fixture(scope="module")
def references(checkpoints):
    """Greedy outputs of each checkpoint without speculation."""
    refs = {}
    for name in ("qwen3", "llama"):
        llm = LLM(checkpoints[name], **OPTIONS)
        refs[name] = outputs(llm, PROMPTS, GREEDY)
    return refs


# -------------------------------------------------------------------------------------------------
# config

def test_config_follows_vllms_shape_and_refuses_what_it_cannot_run():
    # vLLM: neither given -> 5 and 5
    assert SpeculativeConfig.of({"method": "ngram"}).prompt_lookup_min == 5
    c = SpeculativeConfig.of({"method": "ngram", "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.of({"model": "/some/draft"}).method == "draft_model"
    assert SpeculativeConfig.of({"method": "mtp", "num_speculative_tokens": 2}).model is None
    for bad, match in (({"method": "eagle", "model": "x"}, "method='eagle' is not supported"),
                       ({"method": "mtp", "model": "x"}, "method='mtp' takes no 'model'"), ({
            "method": "ngram", "speculative_model": "x"
    }, "unknown key"), ({"method": "ngram",
                         "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
                       ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                        "is above"), ({"method": "draft_model"}, "needs 'model'"),
                       ({"model": "x", "draft_tensor_parallel_size": 2},
                        "runs whole on rank 0"), ("ngram", "must be a dict")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.of(bad)


def test_a_missing_draft_or_another_vocabulary_is_named(checkpoints, tmp_path):
    with pytest.raises(Exception, match="no-such-draft"):
        LLM(checkpoints["qwen3"], speculative_config={"model": str(tmp_path / "no-such-draft")},
            **OPTIONS)
    wide = str(tmp_path / "wide")
    config = tiny_text_config("qwen3", True)
    config.vocab_size = 640
    build_checkpoint(wide, config)
    with pytest.raises(ValueError, match="vocabulary of 640 tokens and the target 512"):
        LLM(checkpoints["qwen3"], speculative_config={"model": wide}, **OPTIONS)


# -------------------------------------------------------------------------------------------------
# ngram

def test_ngram_takes_the_longest_recurring_suffix_and_a_whole_continuation():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    # "1 2 3" recurs at 0 and 5; the latest one followed by k tokens proposes.
    assert propose_ngram(tokens, 3, 1, 3, frozenset()) == [4, 5, 6]
    assert propose_ngram(tokens, 3, 1, 3, frozenset({5})) == [4]  # cut before a placeholder
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3, frozenset()) == []
    # fewer than k after the only hit
    assert propose_ngram([7, 8, 7, 8, 7], 4, 2, 2, frozenset()) == [8, 7]
    assert propose_ngram([5, 6, 1, 5, 7, 5], 2, 1, 3, frozenset()) == [7, 5]  # n=1: the latest "5"


# ---------------------------------------------------------------------------------------- greedy
# identity

@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-other"])
def test_greedy_outputs_equal_those_without_speculation(checkpoints, references, family, proposer):
    spec = NGRAM if proposer == "ngram" else \
        {"model": checkpoints[family if proposer == "draft-self" else "other-qwen3"],
         "num_speculative_tokens": 3, "adaptive": False}
    if proposer == "draft-other" and family == "llama":
        spec["model"] = checkpoints["qwen3"]  # another architecture of the same vocabulary
    llm = LLM(checkpoints[family], speculative_config=spec, **OPTIONS)
    assert outputs(llm, PROMPTS, GREEDY) == references[family]
    spec_state = llm.engine.speculator
    assert spec_state.num_draft_tokens > 0
    if proposer == "draft-self":  # the target as its own draft: every proposal is accepted
        assert spec_state.num_accepted_tokens == spec_state.num_draft_tokens
    assert_pools_empty(llm)


@pytest.mark.parametrize(
    "path", ["chunked-prefill", "preemption", "prefix-cache", "mixed-lengths", "adaptive"])
def test_greedy_identity_on_every_scheduling_path(checkpoints, references, path):
    options = dict(OPTIONS)
    spec = dict(NGRAM, adaptive=path == "adaptive")
    prompts, want = PROMPTS, references["qwen3"]
    if path == "chunked-prefill":  # prompts prefill in chunks beside other sequences' verifications
        options.update(max_num_batched_tokens=16, max_model_len=128)
    elif path == "preemption":  # a pool of 12 blocks for four sequences of up to 70 tokens
        options.update(kv_cache_bytes=12 * 2 * 2 * 2 * 16 * 16 * 4, max_model_len=80)
    elif path == "prefix-cache":
        prompts, want = PROMPTS + PROMPTS, want + want
    llm = LLM(checkpoints["qwen3"], speculative_config=spec, **options)
    # sequences finishing at different steps, some by max_tokens inside a proposal
    if path == "mixed-lengths":
        params = [
            SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 7, 23, 2)
        ]
        got = [
            o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p}
                                                          for p in prompts], params, use_tqdm=False)
        ]
        assert got == [w[:m] for w, m in zip(want, (40, 7, 23, 2))]
    else:
        assert outputs(llm, prompts, GREEDY) == want
    if path == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if path == "prefix-cache":
        assert llm.engine.speculator.num_accepted_tokens > 0
    assert llm.engine.speculator.num_draft_tokens > 0
    assert_pools_empty(llm)


def test_stop_strings_eos_and_logprobs_are_those_without_speculation(checkpoints):
    base = LLM(checkpoints["qwen3"], **OPTIONS)
    spec = LLM(checkpoints["qwen3"], speculative_config=NGRAM, **OPTIONS)
    ref_text = base.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY,
                             use_tqdm=False)[0].outputs[0].text
    stop = ref_text[len(ref_text) // 2:len(ref_text) // 2 + 3]
    eos_at = outputs(base, PROMPTS[2:3], GREEDY)[0][9]
    for params in (SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                   SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[eos_at]),
                   SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)):
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        want, got = base.generate(prompts, params,
                                  use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason) == \
                (w.outputs[0].token_ids, w.outputs[0].text, w.outputs[0].finish_reason)
            for lw, lg in zip(w.outputs[0].logprobs or [], g.outputs[0].logprobs or []):
                assert lw.keys() == lg.keys()
                assert all(
                    abs(lw[t].logprob - lg[t].logprob) < 1e-4 and lw[t].rank == lg[t].rank
                    for t in lw)
    assert spec.engine.speculator.num_accepted_tokens > 0
    assert_pools_empty(spec)


def test_structured_outputs_decode_unspeculated_beside_speculated_sequences(checkpoints, caplog):
    caplog.set_level("INFO", logger="vlinfer")
    from vlinfer.sampling_params import StructuredOutputsParams
    base = LLM(checkpoints["qwen3"], **OPTIONS)
    spec = LLM(checkpoints["qwen3"], speculative_config=NGRAM, **OPTIONS)
    constrained = SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(regex="(ab|cd){1,5}x"))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [constrained, GREEDY, constrained, GREEDY]
    want, got = base.generate(prompts, params,
                              use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.metrics.spec_num_draft_tokens == 0 for o in got] == [True, False, True, False]
    assert [r.message for r in caplog.records
            ].count("speculative decoding: requests with structured outputs decode "
                    "one token a step (their grammar would have to advance over "
                    "proposals that may be rejected)") == 1
    assert_pools_empty(spec)


def test_images_prompts_never_propose_placeholders_and_keep_outputs(monkeypatch, tmp_path):
    from images import picture
    from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
    path = build_tiny_qwen3_vl(str(tmp_path / "vl"), seed=0, num_heads=4, num_kv_heads=2,
                               head_dim=32, mrope_section=(6, 5, 5), vision_depth=2,
                               deepstack_visual_indexes=[0, 1], tie_word_embeddings=False)
    prompt = (
        "<|im_start|>user\nSay <|vision_start|><|image_pad|><|vision_end|> and repeat: one two "
        "three one two "
        "three one two<|im_end|>\n<|im_start|>assistant\n")
    requests = [{"prompt": prompt, "multi_modal_data": {"image": picture(96, 128, s)}}
                for s in (1, 2)]
    base = LLM(path, dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=1024)
    want = [o.outputs[0].token_ids for o in base.generate(requests, GREEDY, use_tqdm=False)]
    proposed = []
    real = ngram.propose_ngram

    def recording(token_ids, k, lo, hi, never):
        out = real(token_ids, k, lo, hi, never)
        proposed.append((out, never))
        return out
    monkeypatch.setattr(speculator, "propose_ngram", recording)
    spec = LLM(
        path, dtype="float32", kv_cache_bytes=32 * 2**20, max_model_len=1024, speculative_config={
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2
        })
    got = [o.outputs[0].token_ids for o in spec.generate(requests, GREEDY, use_tqdm=False)]
    assert got == want
    image_pad = spec.engine.hf_config.image_token_id
    assert proposed and all(never == {image_pad, spec.engine.hf_config.video_token_id}
                            for _, never in proposed)
    assert not any(image_pad in out for out, _ in proposed)
    assert_pools_empty(spec)


@pytest.mark.slow  # 40 s: the real model, prompt lookup and plain decoding compared
def test_the_real_smollm2_copies_with_the_same_tokens():
    prompt = (
        "<|im_start|>user\nRepeat exactly: The quick brown fox jumps over the lazy dog near the "
        "river bank."
        "<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(temperature=0, max_tokens=24)
    base = LLM("smollm2", kv_cache_bytes=32 * 2 ** 20, max_model_len=512)
    spec = LLM(
        "smollm2", kv_cache_bytes=32 * 2**20, max_model_len=512, speculative_config={
            "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4, "adaptive": False
        })
    want = base.generate([prompt], params, use_tqdm=False)[0]
    got = spec.generate([prompt], params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert "quick brown fox" in got.outputs[0].text
    assert got.metrics.spec_acceptance_rate >= 0.5 and got.metrics.spec_mean_accepted_length > 2
    assert_pools_empty(spec)


# -----------------------------------------------------------------------------------------------
# sampling

def test_a_verified_row_draws_from_the_processed_distribution():
    """20000 sequences, each with one proposal d, through sample(): the first token follows row 0's
    processed distribution p0 (total variation under 0.015, as test_sampling's draws), d is emitted
    with probability p0(d), and after an accepted d the second token follows row 1's distribution
    with d counted as output (its presence penalty applied) within 0.03; a rejected d never emits a
    second token."""
    n, vocab = 20000, 12
    logits = torch.tensor([[2.0, 3.1, 1.2, 2.6, 0.4, 1.9, -0.5, 2.2, 0.9, 1.5, -2.0, 0.0],
                           [1.0, 0.5, 2.9, 1.7, 2.8, 0.3, 1.1, -1.0, 2.0, 0.2, 0.4, 1.3]])
    params = SamplingParams(temperature=0.9, top_k=9, presence_penalty=0.8)
    d = 3
    generator = torch.Generator().manual_seed(99)
    seqs = []
    for _ in range(n):
        seq = Sequence([5, 6], params, generator=generator)
        seq.spec_token_ids = [d]
        seqs.append(seq)
    tokens, _ = sampler.sample(logits.repeat(n, 1), seqs, set())
    plain = Sequence([5, 6], params)
    p0 = sampler.warp_logits(sampler.process_logits(logits[:1].clone(), [plain], set()),
                             [params]).softmax(-1)[0]
    plain.append_token(d)
    p1 = sampler.warp_logits(sampler.process_logits(logits[1:].clone(), [plain], set()),
                             [params]).softmax(-1)[0]
    assert p1[d] < torch.softmax(logits[1] / 0.9, -1)[d]  # the penalty moved row 1
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=vocab).float() / n
    assert 0.5 * (first - p0).abs().sum() < 0.015
    assert all(len(t) == (2 if t[0] == d else 1) for t in tokens)
    second = torch.tensor([t[1] for t in tokens if len(t) == 2])
    assert len(second) > 3000
    empirical = torch.bincount(second, minlength=vocab).float() / len(second)
    assert 0.5 * (empirical - p1).abs().sum() < 0.03


@pytest.mark.parametrize("proposer", ["ngram", "draft-self"])
def test_sampled_continuations_are_distributed_as_without_speculation(checkpoints, references,
                                                                      proposer):
    """6000 seeded draws of a three-token continuation (temperature 0.7, top-k 4) with and without
    speculation (the first token comes from the prefill; the second and third are proposed and
    verified): in each run, the second token's frequencies after the most frequent first token a,
    and the third's after the most frequent (a, b), against transformers' processed distributions,
    in total variation (bounds 3x the sampling noise)."""
    # the model's likely tokens recur: n-grams hit
    n, prompt = 6000, PROMPTS[0] + references["qwen3"][0][:12]
    params = SamplingParams(n=n, temperature=0.7, top_k=4, max_tokens=3, ignore_eos=True, seed=3)
    spec = NGRAM if proposer == "ngram" else {
        "model": checkpoints["qwen3"], "num_speculative_tokens": 2, "adaptive": False
    }
    spec = dict(spec, disable_by_batch_size=n)
    # A token budget past what 1024 sequences use: proposals take what admissions leave
    # (speculator.py).
    options = dict(OPTIONS, kv_cache_bytes=128 * 2**20, max_num_seqs=1024,
                   max_num_batched_tokens=32768)
    runs = {}
    for name, extra in (("plain", {}), ("speculative", {"speculative_config": spec})):
        llm = LLM(checkpoints["qwen3"], **options, **extra)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        runs[name] = np.array([c.token_ids for c in out.outputs])
        if extra:
            assert llm.engine.speculator.num_accepted_tokens > 1000
            assert_pools_empty(llm)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], dtype=torch.float32).eval()

    def processed(ids):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1] / 0.7
        return row.masked_fill(row < row.topk(4).values[-1], float("-inf")).softmax(-1)

    def tv(draws, ids):
        empirical = torch.bincount(torch.tensor(draws), minlength=512).float() / len(draws)
        # E[TV] bound over 4 kept tokens
        noise = 0.5 * float(np.sqrt(2 / np.pi) * np.sqrt(4 / len(draws)))
        return 0.5 * (empirical - processed(ids)).abs().sum().item(), 3 * noise

    plain = runs["plain"]
    a = int(np.bincount(plain[:, 0]).argmax())
    b = int(np.bincount(plain[plain[:, 0] == a][:, 1]).argmax())
    for name, draws in runs.items():
        after_a = draws[draws[:, 0] == a]
        after_ab = after_a[after_a[:, 1] == b]
        assert len(after_ab) > 500, name
        for got, bound in (tv(after_a[:, 1], prompt + [a]), tv(after_ab[:, 2], prompt + [a, b])):
            assert got < bound, (name, got, bound)


def plant_acceptance_bias(monkeypatch, bias: float):
    """The acceptance rule with a planted bias: each proposal's acceptance uniform lowered by bias,
    so a proposal d is accepted with probability p(d) + bias (the control: it must fail)."""
    draw = sampler._uniforms

    def biased(seq, count, device):
        u = draw(seq, count, device)
        k = len(seq.spec_token_ids)
        u[:k] = (u[:k] - bias).clamp(min=0.0)
        return u

    monkeypatch.setattr(sampler, "_uniforms", biased)


VERIFIED_DRAWS = 9000
# a prompt whose likeliest first token a and second token b are likely: fewer draws see the bias
SKEWED_PROMPT = [(3 * j + 11) % 500 + 3 for j in range(12)]
BIAS = 0.03


@pytest.mark.parametrize("bias", [0.0, BIAS], ids=["exact", "planted-3%-bias"])
def test_a_verified_token_is_distributed_within_a_3_percent_bias(checkpoints, monkeypatch, bias):
    """VERIFIED_DRAWS seeded three-token continuations (temperature 0.7, top-k 2) on the dense
    path: the first token comes from the prefill, the second is always proposed (b, transformers'
    likeliest after the likeliest first token a) and verified by rejection sampling. After a, the
    second token takes two values, so its total variation from transformers' processed
    distribution is |f - p| (f: b's frequency, p: its probability), a binomial mean's deviation of
    standard error s = sqrt(p (1 - p) / m) over the m draws that start with a. The bound is 4 s (a
    false alarm one run in 16000); a 3% bias fails when 3% - 4 s exceeds 2 s, so the test first
    asserts 6 s <= 0.03, i.e. m >= 10000 * 4 p (1 - p) draws after a, or 10000 * 4 p (1 - p) / p(a)
    draws in all: VERIFIED_DRAWS covers that on SKEWED_PROMPT (a likely a, a likely b; with
    top-k 4 and a flat prompt the need is several times larger). The same run with the acceptance
    rule biased by 3% (a planted bug: proposals accepted with p(d) + 0.03) must exceed the bound."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], dtype=torch.float32).eval()
    prompt = SKEWED_PROMPT

    def processed(ids):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1] / 0.7
        return row.masked_fill(row < row.topk(2).values[-1], float("-inf")).softmax(-1)

    a = int(processed(prompt).argmax())
    b = int(processed(prompt + [a]).argmax())
    p = float(processed(prompt + [a])[b])
    monkeypatch.setattr(speculator, "propose_ngram",
                        lambda ids, k, *_: [b] if len(ids) == len(prompt) + 1 else [])
    if bias:
        plant_acceptance_bias(monkeypatch, bias)
    n = VERIFIED_DRAWS
    spec = dict(NGRAM, disable_by_batch_size=n)
    options = dict(OPTIONS, kv_cache_bytes=128 * 2**20, max_num_seqs=2048,
                   max_num_batched_tokens=32768)
    llm = LLM(checkpoints["qwen3"], **options, speculative_config=spec)
    # three tokens: a proposal is made only where a token is left after it
    params = SamplingParams(n=n, temperature=0.7, top_k=2, max_tokens=3, ignore_eos=True, seed=5)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    draws = np.array([c.token_ids for c in out.outputs])
    assert llm.engine.speculator.num_draft_tokens == n  # every second token was verified
    assert_pools_empty(llm)
    after_a = draws[draws[:, 0] == a][:, 1]
    m = len(after_a)
    s = float(np.sqrt(p * (1 - p) / m))
    assert 6 * s <= BIAS, f"{m} draws after a cannot see a {BIAS:.0%} bias (s = {s:.4f})"
    gap = abs(float((after_a == b).mean()) - p)
    if bias:
        assert gap > 4 * s, (gap, 4 * s)
    else:
        assert gap < 4 * s, (gap, 4 * s)


def test_seeded_requests_repeat(checkpoints):
    llm = LLM(checkpoints["qwen3"], speculative_config=NGRAM, **OPTIONS)
    params = SamplingParams(temperature=0.8, max_tokens=30, seed=11, ignore_eos=True)
    assert outputs(llm, PROMPTS, params) == outputs(llm, PROMPTS, params)


# ------------------------------------------------------------------------------------------- engine
# state

def test_aborts_between_verifications_leave_both_pools_empty(checkpoints):
    for spec in (NGRAM, {
            "model": checkpoints["other-qwen3"], "num_speculative_tokens": 3, "adaptive": False
    }):
        llm = LLM(checkpoints["qwen3"], speculative_config=spec, **OPTIONS)
        engine = llm.engine
        ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
        for _ in range(4):
            engine.step()
        assert engine.speculator.num_drafts > 0
        engine.abort_request(ids[0])
        engine.abort_request(ids[2])
        while engine.has_unfinished_requests():
            engine.step()
        assert_pools_empty(llm)


def test_a_stream_shows_only_accepted_tokens(checkpoints, references):
    """Step outputs: each delta extends the one before, several tokens at once when proposals were
    accepted, and together they are exactly the final tokens, which equal those without speculation.
    """
    llm = LLM(checkpoints["qwen3"], speculative_config=NGRAM, **OPTIONS)
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    seen, sizes = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            assert c.token_ids[:len(seen)] == seen  # nothing shown is ever taken back
            seen += c.delta_token_ids
            sizes.append(len(c.delta_token_ids))
            assert c.token_ids == seen, rid
    assert seen == references["qwen3"][0] and max(sizes) > 1


def test_the_adaptive_rule_pauses_failing_sequences_and_large_batches(checkpoints):
    seq = Sequence([1, 2, 3], GREEDY)
    spec = speculator.Speculator(SpeculativeConfig.of(dict(NGRAM, adaptive=True)), 100, frozenset())
    pauses = []
    for _ in range(7):
        seq.spec_token_ids = [4, 5]
        seq.append_token(9)
        spec.record([(seq, [9], [None])])
        pauses.append(spec.pause_steps[seq.seq_id])
    assert pauses == [1, 3, 7, 15, 31, 31, 31]
    seq.spec_token_ids = [4]
    spec.record([(seq, [4, 9], [None, None])])
    assert (spec.misses[seq.seq_id], spec.pause_steps[seq.seq_id]) == (0, 0)
    # Without the adaptive rules a failing sequence keeps proposing.
    plain = speculator.Speculator(SpeculativeConfig.of(NGRAM), 100, frozenset())
    seq.spec_token_ids = [4]
    seq.append_token(9)
    plain.record([(seq, [9], [None])])
    assert plain.pause_steps.get(seq.seq_id, 0) == 0
    # disable_by_batch_size: four sequences in a step of a limit of three propose nothing.
    llm = LLM(checkpoints["qwen3"], speculative_config=dict(NGRAM, disable_by_batch_size=3),
              **OPTIONS)
    outputs(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert llm.engine.speculator.num_drafts == 0


def test_each_batch_size_keeps_the_faster_way_and_probes_the_other():
    """BatchClassRates: a class tries proposing, then not; keeps the one that emitted more tokens a
    second; runs the other at step PROBE_EVERY, then ever more rarely while the probes confirm the
    choice; a change in the measured rates turns the choice around at once. Classes are apart."""
    rates = speculator.BatchClassRates()
    assert rates.choose(8) is True
    rates.record(8, True, 40, 1.0)  # proposing: 40 tokens a second
    assert rates.choose(9) is False  # 8 and 9: one class (8-15), whose other way is untried
    rates.record(9, False, 80, 1.0)  # not proposing: 80
    ways = [rates.choose(12) for _ in range(2 * speculator.PROBE_EVERY)]  # steps 3-66
    assert [i + 3 for i, way in enumerate(ways)
            if way] == [speculator.PROBE_EVERY, 2 * speculator.PROBE_EVERY]
    later = [rates.choose(12) for _ in range(1000)]  # steps 67-1066: probes at 128, 256, 512, 1024
    assert sum(later) == 4
    assert rates.choose(1) is True  # another class starts untried
    for _ in range(20):  # proposing became faster (a copy-heavy stretch)
        rates.record(8, True, 200, 1.0)
    assert all(rates.choose(8) for _ in range(100))


def test_metrics_per_request_and_on_the_server(checkpoints):
    import httpx
    from vlinfer.engine.engine_loop import EngineLoop
    from vlinfer.serve import ServeConfig, build_app
    from serve_helpers import ServerThread
    llm = LLM(checkpoints["qwen3"], speculative_config=NGRAM, **OPTIONS)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    m = out.metrics
    assert m.spec_num_draft_tokens >= m.spec_num_accepted_tokens > 0
    assert m.spec_acceptance_rate == m.spec_num_accepted_tokens / m.spec_num_draft_tokens
    assert m.spec_mean_accepted_length == 1 + m.spec_num_accepted_tokens / m.spec_num_drafts
    loop = EngineLoop(llm.engine)
    try:
        with ServerThread(build_app(loop, ServeConfig(served_model_names=("tiny",)))) as url:
            r = httpx.post(
                url + "/v1/completions",
                json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 20,
                      "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            text = httpx.get(url + "/metrics", timeout=60).text
    finally:
        loop.close()
    spec = llm.engine.speculator
    assert f"vlinfer_spec_decode_num_draft_tokens_total {float(spec.num_draft_tokens)}" in text
    assert (f"vlinfer_spec_decode_num_accepted_tokens_total {float(spec.num_accepted_tokens)}"
            in text)
    assert 'vlinfer_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    assert "vlinfer_spec_decode_acceptance_rate" in text


@pytest.mark.slow  # two processes: `make test-full` and CI run it
def test_tensor_parallel_greedy_identity(checkpoints, references):
    """TP=2: the target's verification runs on both ranks; the draft model runs whole on rank 0."""
    for spec in (NGRAM, {"model": checkpoints["other-qwen3"], "num_speculative_tokens": 3}):
        with LLM(checkpoints["qwen3"], tensor_parallel_size=2, speculative_config=spec,
                 **OPTIONS) as llm:
            assert outputs(llm, PROMPTS, GREEDY) == references["qwen3"]
            assert llm.engine.speculator.num_draft_tokens > 0
            assert_pools_empty(llm)


def test_a_draft_whose_proposals_the_target_dropped_keeps_a_valid_cache(checkpoints):
    """Found by tests/engine/test_engine_state_machine.py (the long run, draft engine): in a pool
    too small for every proposal, the draft proposed, the target had no free block for the proposal
    and dropped it; the shadow kept the KV of its own proposed tokens as if verified, and its next
    catch-up chunk was empty (an IndexError). A shadow now keeps its KV only over the tokens the
    target kept. The same crowd, to the end: the tokens of each request alone, both pools empty."""
    spec = {"model": checkpoints["other-qwen3"], "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(checkpoints["qwen3"], speculative_config=spec, dtype="float32",
              kv_cache_bytes=12 * 8192 * 2, max_model_len=128)
    prompts = [[3] * 41, [3] * 40, [3] * 41, [3] * 40]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [outputs(LLM(checkpoints["qwen3"], **OPTIONS), [p], params)[0] for p in prompts[:2]]
    assert outputs(llm, prompts, params) == alone * 2
    assert llm.engine.speculator.draft.num_pool_misses > 0 \
        or llm.engine.scheduler.num_preemptions > 0
    assert_pools_empty(llm)
