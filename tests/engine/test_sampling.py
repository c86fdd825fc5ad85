"""Sampling, proven: each option of vlinfer/engine/sampler.py against transformers' logits
processors on the same logits (presence / frequency penalties against vLLM's and OpenAI's
definition), one step at a time and as one chain; the draws against the processed distribution;
logprobs against transformers' model along the generated path; and logit_bias / allowed_token_ids /
bad_words / stop_token_ids / ignore_eos / min_tokens from SamplingParams to the tokens an engine
generates."""
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from vlinfer import LLM, RequestError, SamplingParams
from vlinfer.engine.sequence import Sequence
from vlinfer.engine import sampler

VOCAB = 50
EOS = {2}


def make_seq(params: SamplingParams, prompt, output=(), bad_words_token_ids=(),
             generator=None) -> Sequence:
    """The engine's own Sequence with a prompt, tokens already generated and the tokenized bad words
    set, as the sampler reads it at a step."""
    seq = Sequence(
        list(prompt), params,
        generator=generator if generator is not None else torch.Generator().manual_seed(0))
    for token in output:
        seq.append_token(token)
    seq.bad_words_token_ids = [list(w) for w in bad_words_token_ids]
    return seq


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def processed(logits: torch.Tensor, seqs: list[Sequence], eos=EOS) -> torch.Tensor:
    """What sample() takes the arg-max of (greedy rows) or draws from (sampled rows)."""
    x = sampler.process_logits(logits.clone(), seqs, eos)
    rows = [i for i, s in enumerate(seqs) if not s.sampling_params.greedy]
    if rows:
        x[rows] = sampler.warp_logits(x[rows], [seqs[i].sampling_params for i in rows])
    return x


def hf(processors, input_ids: list[int], row: torch.Tensor) -> torch.Tensor:
    """transformers' processors in turn on one row; input_ids are what transformers sees (prompt and
    output)."""
    ids, scores = torch.tensor([list(input_ids)], dtype=torch.long), row[None].clone()
    for processor in processors:
        scores = processor(ids, scores)
    return scores[0]


def assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """The same tokens masked, and the kept logits equal to float32 rounding."""
    masked, ref_masked = torch.isneginf(ours), torch.isneginf(ref)
    assert torch.equal(masked,
                       ref_masked), f"masks differ at {(masked != ref_masked).nonzero().tolist()}"
    torch.testing.assert_close(ours[~masked], ref[~ref_masked], rtol=1e-6, atol=1e-6)


def openai_penalties(presence: float, frequency: float, output: list[int]):
    """vLLM's and OpenAI's definition, written out: logits[t] -= presence * (count > 0) + frequency
    * count over the generated tokens."""
    def apply(_ids, scores):
        scores = scores.clone()
        for token, count in Counter(output).items():
            scores[0, token] -= presence + frequency * count
        return scores
    return apply


# ------------------------------------------------------------------------------------------ one
# option at a time

@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.8])
def test_temperature_is_transformers_temperature_warper(temperature):
    logits = random_logits(3, seed=1)
    seqs = [make_seq(SamplingParams(temperature=temperature), [4, 5]) for _ in range(3)]
    ours = processed(logits, seqs)
    for i in range(3):
        assert_same(ours[i], hf([TemperatureLogitsWarper(temperature)], [4, 5], logits[i]))


def test_top_k_is_transformers_top_k_warper():
    ks = [1, 2, 7, 49, 50, 0]  # 0: off; rows of one batch with different k
    logits = random_logits(len(ks), seed=2)
    ours = processed(logits, [make_seq(SamplingParams(top_k=k), [4]) for k in ks])
    for i, k in enumerate(ks):
        assert_same(ours[i], hf([TopKLogitsWarper(k)] if k else [], [4], logits[i]))
        assert (~ours[i].isneginf()).sum() == (k or VOCAB)


def test_top_p_is_transformers_top_p_warper():
    ps = [0.01, 0.2, 0.5, 0.75, 0.9, 0.99, 1.0]
    # one flat-ish row: each p keeps a different set
    logits = (random_logits(1, seed=3) / 3).expand(len(ps), -1)
    ours = processed(logits, [make_seq(SamplingParams(top_p=p), [4]) for p in ps])
    for i, p in enumerate(ps):
        assert_same(ours[i], hf([TopPLogitsWarper(p)] if p < 1 else [], [4], logits[i]))
    kept = (~ours.isneginf()).sum(-1).tolist()
    assert kept[0] == 1 and kept[-1] == VOCAB and len(set(kept)) == len(ps), kept


def test_min_p_is_transformers_min_p_warper():
    ps = [0.0, 0.05, 0.1, 0.3, 0.6, 1.0]
    # one flat-ish row: each p keeps a different set
    logits = (random_logits(1, seed=4) / 3).expand(len(ps), -1)
    ours = processed(logits, [make_seq(SamplingParams(min_p=p), [4]) for p in ps])
    for i, p in enumerate(ps):
        assert_same(ours[i], hf([MinPLogitsWarper(p)] if p else [], [4], logits[i]))
    kept = (~ours.isneginf()).sum(-1).tolist()
    assert kept[0] == VOCAB and kept[-1] == 1 and len(set(kept)) == len(ps), kept


def test_repetition_penalty_is_transformers_over_prompt_and_output():
    prompt, output = [3, 7, 7, 12, 40], [12, 19, 3, 19, 21]
    for penalty in (1.3, 0.7, 2.0):
        logits = random_logits(1, seed=5)
        ours = processed(logits,
                         [make_seq(SamplingParams(repetition_penalty=penalty), prompt, output)])[0]
        assert_same(ours, hf([RepetitionPenaltyLogitsProcessor(penalty)], prompt + output,
                             logits[0]))
        for prompt_only in (7, 40):  # penalized though only the prompt has them
            assert ours[prompt_only] != logits[0, prompt_only]
        untouched = [t for t in range(VOCAB) if t not in prompt + output]
        assert torch.equal(ours[untouched], logits[0, untouched])


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.5), (-1.0, 2.0)])
def test_presence_and_frequency_penalties_are_openais_over_output_tokens(presence, frequency):
    prompt, output = [3, 9, 9, 30], [9, 14, 14, 14, 30, 8]
    logits = random_logits(2, seed=6)
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    ours = processed(logits, [make_seq(params, prompt, output), make_seq(params, prompt)])
    assert_same(ours[0],
                hf([openai_penalties(presence, frequency, output)], prompt + output, logits[0]))
    # nothing generated yet: the prompt's tokens are not penalized
    assert torch.equal(ours[1], logits[1])
    assert ours[0, 3] == logits[0, 3]  # a prompt-only token


def test_repetition_then_presence_and_frequency_in_vllms_order():
    prompt, output = [3, 9, 9, 30], [9, 14, 14, 30, 8, 3]
    logits = random_logits(1, seed=7)
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.8, frequency_penalty=0.6)
    ours = processed(logits, [make_seq(params, prompt, output)])[0]
    ref = hf([RepetitionPenaltyLogitsProcessor(1.7),
              openai_penalties(0.8, 0.6, output)], prompt + output, logits[0])
    assert_same(ours, ref)


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos", "ignore-eos"])
def test_min_tokens_masks_eos_and_stop_ids_as_transformers_min_new_tokens(ignore_eos):
    """Until min_tokens tokens are out, EOS and stop_token_ids are masked, EOS even under ignore_eos
    (vLLM's min_tokens masks every stop id it knows, the model's EOS included). An EOS id past the
    model's head (a large tokenizer's) is skipped."""
    prompt, eos = [4, 5, 6], {2, 5, 151645}
    params = SamplingParams(min_tokens=3, stop_token_ids=[7, 11], ignore_eos=ignore_eos)
    for num_out in range(6):
        output = [20 + i for i in range(num_out)]
        logits = random_logits(1, seed=8 + num_out)
        ours = processed(logits, [make_seq(params, prompt, output)], eos)[0]
        ref = hf([MinNewTokensLengthLogitsProcessor(len(prompt), 3, [2, 5, 7, 11])],
                 prompt + output, logits[0])
        assert_same(ours, ref)
        assert ours[[2, 5, 7, 11]].isneginf().all() == (num_out < 3)


def test_logit_bias_is_transformers_sequence_bias():
    biases = [{3: 5.0, 10: -2.5, 49: 100.0}, {0: -100.0}, None]
    logits = random_logits(3, seed=9)
    ours = processed(logits,
                     [make_seq(SamplingParams(logit_bias=b, temperature=0), [4]) for b in biases])
    for i, bias in enumerate(biases):
        ref = hf([SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])] if bias else [],
                 [4], logits[i])
        assert_same(ours[i], ref)


def test_allowed_token_ids_is_transformers_prefix_constraint():
    allowed = [[3, 17, 40], [0], None, list(range(VOCAB))]
    logits = random_logits(len(allowed), seed=10)
    ours = processed(logits, [make_seq(SamplingParams(allowed_token_ids=a), [4]) for a in allowed])
    for i, ids in enumerate(allowed):
        ref = hf([PrefixConstrainedLogitsProcessor(lambda _b, _s, ids=ids: ids, 1)] if ids else [],
                 [4], logits[i])
        assert_same(ours[i], ref)
        assert (~ours[i].isneginf()).sum() == len(ids or range(VOCAB))


BAD_WORDS = [[5], [8, 9], [3, 4, 6]]


@pytest.mark.parametrize("output", [[], [8], [1, 8], [3, 4], [3, 4, 8], [4], [3, 8, 9]])
def test_bad_words_are_transformers_no_bad_words_over_the_output(output):
    """vLLM's bad_words: a word's last token is masked when the output so far ends with the rest of
    the word; transformers' NoBadWordsLogitsProcessor does the same given the output tokens."""
    logits = random_logits(1, seed=11)
    ours = processed(logits, [make_seq(SamplingParams(), [1, 2], output, BAD_WORDS)])[0]
    assert_same(ours, hf([NoBadWordsLogitsProcessor(BAD_WORDS)], output, logits[0]))


def test_bad_words_look_at_the_output_not_the_prompt():
    """vLLM matches a word's prefix against generated tokens only: a prompt ending in 8 does not ban
    9 (transformers, which sees the prompt too, would)."""
    logits = random_logits(1, seed=12)
    ours = processed(logits, [make_seq(SamplingParams(), [1, 3, 4, 8], [], BAD_WORDS)])[0]
    assert torch.isneginf(ours).nonzero().flatten().tolist() == [5]
    assert hf([NoBadWordsLogitsProcessor(BAD_WORDS)], [1, 3, 4, 8], logits[0]).isneginf().sum() == 2


# -------------------------------------------------------------------------------------------------
# the chain

def test_warpers_run_in_transformers_order():
    """temperature, top-k, top-p, min-p, as transformers chains them. Several of these rows mask
    differently with min-p first (vLLM's order), so the test tells the orders apart."""
    combos = [(0.7, 10, 0.9, 0.05), (1.3, 0, 0.6, 0.2), (0.5, 5, 1.0, 0.3), (1.0, 30, 0.8, 0.0),
              (2.0, 20, 0.95, 0.1)]
    logits = random_logits(len(combos), seed=13)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in combos]
    ours = processed(logits, [make_seq(p, [4]) for p in params])
    orders_differ = 0
    for i, (t, k, p, m) in enumerate(combos):
        temp, top_k = TemperatureLogitsWarper(t), [TopKLogitsWarper(k)] if k else []
        top_p, min_p = [TopPLogitsWarper(p)] if p < 1 else [], [MinPLogitsWarper(m)] if m else []
        assert_same(ours[i], hf([temp, *top_k, *top_p, *min_p], [4], logits[i]))
        vllm_order = hf([temp, *min_p, *top_k, *top_p], [4], logits[i])
        orders_differ += not torch.equal(vllm_order.isneginf(), ours[i].isneginf())
    assert orders_differ >= 2


def test_one_mixed_batch_is_each_rows_transformers_chain():
    """Rows with different options in one batch, each against transformers' processors in the
    sampler's order (bias, repetition, presence / frequency, bad words, min_tokens, allowed ids,
    then the warpers): no row's options leak into another's, and the vectorized paths agree with the
    row-by-row reference."""
    prompt = [3, 9, 9, 30, 4]
    rows = [
        (dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02, repetition_penalty=1.4,
              presence_penalty=0.5, frequency_penalty=0.3, logit_bias={9: 2.0, 17: -3.0},
              min_tokens=5), [9, 14, 14], []),
        (dict(temperature=0, repetition_penalty=0.8, allowed_token_ids=[9, 14, 30, 2,
                                                                        44]), [14, 9], [[14, 44]]),
        (dict(temperature=1.5, top_p=0.7, stop_token_ids=[30], min_tokens=2), [8], [[8, 9], [6]]),
        (dict(temperature=1.0), [], []),
        (dict(temperature=0.6, min_p=0.1, frequency_penalty=-1.0, logit_bias={2: 50.0},
              min_tokens=1), [2, 2, 7], []),
    ]
    seqs = [make_seq(SamplingParams(**kw), prompt, out, bad) for kw, out, bad in rows]
    logits = random_logits(len(rows), seed=14)
    ours = processed(logits, seqs)
    for i, (kw, out, bad) in enumerate(rows):
        p = seqs[i].sampling_params
        chain = []
        if p.logit_bias:
            chain.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()]))
        if p.repetition_penalty != 1:
            chain.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        chain.append(openai_penalties(p.presence_penalty, p.frequency_penalty, out))
        # transformers matches prefixes against the ids it is given: the output only, as vLLM does
        if bad:
            output_ids = torch.tensor([out], dtype=torch.long).reshape(1, -1)
            chain.append(lambda _ids, s, bad=bad, o=output_ids: NoBadWordsLogitsProcessor(bad)
                         (o, s))
        chain.append(
            MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens,
                                              sorted(EOS | set(p.stop_token_ids))))
        if p.allowed_token_ids:
            chain.append(
                PrefixConstrainedLogitsProcessor(lambda _b, _s, a=p.allowed_token_ids: a, 1))
        if not p.greedy:
            chain.append(TemperatureLogitsWarper(float(p.temperature)))
            chain += [TopKLogitsWarper(p.top_k)] if p.top_k else []
            chain += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
            chain += [MinPLogitsWarper(p.min_p)] if p.min_p else []
        assert_same(ours[i], hf(chain, prompt + out, logits[i]))
    # Greedy rows take the arg-max of their processed logits.
    tokens, _ = sampler.sample(logits.clone(), seqs, EOS)
    assert tokens[1] == [ours[1].argmax().item()
                         ] and tokens[1][0] in seqs[1].sampling_params.allowed_token_ids


# -------------------------------------------------------------------------------------------------
# draws

def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


def renormalized(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def test_draws_follow_the_processed_distribution():
    """20000 draws with a fixed seed from one row (temperature, top-k, top-p, min-p and penalties
    together) against the distribution transformers' processors give: total variation under 0.015
    (the sampling noise is ~0.006), no masked token ever drawn, and the same draws at least 0.05
    away from the distribution a top-p mask off by one token (one more kept, or one fewer) would
    give, so a wrong mask fails this bound."""
    n = 20000
    logits = torch.tensor([[2.0, 3.1, 1.2, 2.6, 0.4, 1.9, -0.5, 2.2, 0.9, 1.5, -2.0, 0.0]])
    params = SamplingParams(temperature=0.9, top_k=9, top_p=0.85, min_p=0.02,
                            repetition_penalty=1.2, presence_penalty=0.3)
    prompt, output = [5, 6], [1, 3]
    ref = hf([
        RepetitionPenaltyLogitsProcessor(1.2),
        openai_penalties(0.3, 0.0, output),
        TemperatureLogitsWarper(0.9),
        TopKLogitsWarper(9),
        TopPLogitsWarper(0.85),
        MinPLogitsWarper(0.02)
    ], prompt + output, logits[0])
    expected = ref.softmax(-1)
    generator = torch.Generator().manual_seed(1234)
    seqs = [make_seq(params, prompt, output, generator=generator) for _ in range(n)]
    tokens, _ = sampler.sample(logits.expand(n, -1).clone(), seqs, set())
    counts = torch.bincount(torch.tensor([t for [t] in tokens]), minlength=logits.shape[-1]).float()
    assert counts[expected == 0].sum() == 0, "a masked token was drawn"
    empirical = counts / n
    assert total_variation(empirical, expected) < 0.015
    # The top-p boundary, in transformers' terms: the tokens it keeps, most likely first, and the
    # next one.
    before_top_p = hf([
        RepetitionPenaltyLogitsProcessor(1.2),
        openai_penalties(0.3, 0.0, output),
        TemperatureLogitsWarper(0.9),
        TopKLogitsWarper(9)
    ], prompt + output, logits[0]).softmax(-1)
    order = before_top_p.argsort(descending=True)
    kept = int((expected > 0).sum())
    for wrong in (kept - 1, kept + 1):
        keep = torch.zeros_like(expected, dtype=torch.bool)
        keep[order[:wrong]] = True
        assert total_variation(empirical, renormalized(before_top_p, keep)) > 0.05, wrong


@pytest.mark.parametrize("uniform", [0.0, 1 - 2**-24, 0.5], ids=["zero", "just-below-one", "half"])
def test_the_inverse_cdf_draw_never_returns_a_masked_token(monkeypatch, uniform):
    """A uniform of exactly 0 once picked token 0 whatever its probability. Forced to 0, to the
    largest float32 below 1 and to 0.5, every draw is a token the processed distribution allows: the
    first such token for 0, the last for just below 1."""
    monkeypatch.setattr(sampler, "_uniforms", lambda seq, count, device: torch.full(
        (count, ), uniform))
    logits = random_logits(4, seed=15)
    logits[2, 0] = 30.0  # token 0 the most likely, then masked by allowed_token_ids below
    params = [SamplingParams(allowed_token_ids=[7, 20, 33]), SamplingParams(top_k=3),
              SamplingParams(allowed_token_ids=[1, 5]), SamplingParams(top_p=0.3)]
    # row 3: bad word [0]
    seqs = [make_seq(p, [4], [], [[0]] if i == 3 else []) for i, p in enumerate(params)]
    probs = processed(logits, seqs).softmax(-1)
    tokens, _ = sampler.sample(logits.clone(), seqs, EOS)
    for row, [token] in enumerate(tokens):
        allowed = probs[row].nonzero().flatten().tolist()
        assert token in allowed, (row, token, allowed)
        if uniform == 0.0:
            assert token == allowed[0]
        if uniform > 0.99:
            assert token == allowed[-1]


def test_a_cdf_that_steps_at_a_masked_token_still_picks_a_kept_one():
    """Summed in another order (a parallel scan on an accelerator) a CDF can step by a rounding
    error at a token of probability 0; a draw landing in that step takes the kept token before it,
    or the first kept one."""
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.7, 0.3]])
    cdf = torch.tensor([[0.5, 0.5 + 2 ** -20, 1.0, 1.0], [2 ** -20, 2 ** -20, 0.7, 1.0]])
    assert sampler._inverse_cdf(probs, cdf, torch.tensor([0.5 + 2**-21, 2**-21])).tolist() == [0, 2]


# ----------------------------------------------------------------------------------------------
# through an engine

@pytest.fixture(scope="module")
def llm(qwen3_checkpoint):
    return LLM(qwen3_checkpoint[0], dtype="float32", kv_cache_bytes=4 * 2 ** 20, max_model_len=128)


def test_logprobs_are_transformers_log_softmax_of_raw_logits(llm, qwen3_checkpoint):
    """vLLM's default logprobs (logprobs_mode="raw_logprobs"): log_softmax of the model's own
    logits, before penalties, temperature and masks, here all on, so processed logprobs would fail.
    Each step's values equal transformers' along the generated tokens (float32, within 1e-4); each
    entry holds exactly the `logprobs` most likely tokens and the chosen one."""
    _, model = qwen3_checkpoint
    prompts = [[5, 6, 7, 8], [100, 200, 300, 17, 9, 44, 12]]
    for k in (5, 0):
        params = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.5, seed=3,
                                max_tokens=12, logprobs=k, ignore_eos=True)
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            tokens, entries = out.outputs[0].token_ids, out.outputs[0].logprobs
            assert len(entries) == len(tokens) == 12
            with torch.no_grad():
                ref = torch.log_softmax(
                    model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
            ref = ref[len(prompt) - 1:-1]
            for step, (token, entry) in enumerate(zip(tokens, entries)):
                top = set(ref[step].topk(k).indices.tolist()) if k else set()
                assert set(entry) == top | {token}
                for t, value in entry.items():
                    assert abs(value.logprob - ref[step, t].item()) < 1e-4, (step, t, value,
                                                                             ref[step, t].item())
                    # rank: 1 + how many tokens are more likely, within the float32 tolerance of the
                    # reference
                    above = lambda margin: int(
                        (ref[step] > ref[step, t] + margin).sum())  # noqa: E731
                    assert above(1e-4) <= value.rank - 1 <= above(-1e-4), (step, t, value.rank)
                ranked = sorted((e for i, e in entry.items() if i in top), key=lambda e: -e.logprob)
                assert [e.rank for e in ranked] == list(range(1, len(top) + 1))
                assert token in top or entry[token].rank > k
                assert all(e.decoded_token == llm.get_tokenizer().decode([i])
                           for i, e in entry.items())
            assert out.outputs[0].cumulative_logprob == pytest.approx(
                sum(e[t].logprob for t, e in zip(tokens, entries)), abs=1e-5)


def generate_one(llm, **kwargs):
    return generate_each(llm, kwargs)[0]


def generate_each(llm, *options):
    """One batch, one request per options dict (greedy, 6 tokens unless told), on the same prompt.
    """
    params = [SamplingParams(**{"temperature": 0, "max_tokens": 6, **kw}) for kw in options]
    return [o.outputs[0] for o in llm.generate([[5, 6, 7]] * len(params), params, use_tqdm=False)]


def test_stop_token_ids_ignore_eos_and_min_tokens_end_requests(llm):
    """logit_bias forces a token; EOS then ends the request at once, not before min_tokens, never
    under ignore_eos; a stop_token_id ends it with that id as stop_reason."""
    eos = 2
    assert eos in llm.engine.eos_token_ids
    force_eos = {eos: 100.0}
    out = generate_one(llm, logit_bias=force_eos)
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    out = generate_one(llm, logit_bias=force_eos, min_tokens=3)
    assert eos not in out.token_ids[:3] and out.token_ids[3:] == [eos
                                                                  ] and out.finish_reason == "stop"
    out = generate_one(llm, logit_bias=force_eos, ignore_eos=True)
    assert out.token_ids == [eos] * 6 and out.finish_reason == "length"
    out = generate_one(llm, logit_bias=force_eos, ignore_eos=True, min_tokens=2)
    assert eos not in out.token_ids[:2] and out.token_ids[2:] == [
        eos
    ] * 4 and out.finish_reason == "length"
    out = generate_one(llm, logit_bias={9: 100.0}, stop_token_ids=[9])
    assert out.token_ids == [9] and out.finish_reason == "stop" and out.stop_reason == 9
    out = generate_one(llm, logit_bias={9: 100.0}, stop_token_ids=[9], min_tokens=2)
    assert 9 not in out.token_ids[:2] and out.token_ids[2:] == [9] and out.stop_reason == 9


def test_allowed_token_ids_and_logit_bias_through_generate(llm):
    allowed = [40, 41, 300]
    sampled, biased = generate_each(
        llm,
        dict(temperature=1.5, seed=0, max_tokens=24, allowed_token_ids=allowed, ignore_eos=True),
        # OpenAI's JSON: ids as strings
        dict(logit_bias={"300": 100}, max_tokens=4))
    assert set(sampled.token_ids) <= set(allowed) and len(set(sampled.token_ids)) > 1
    assert biased.token_ids == [300] * 4


def test_bad_words_are_tokenized_as_vllm_does(llm):
    """Each word as the start of the text and after a space (mid-text); on the Qwen tokenizer "inon"
    is [in][on] and [ in][on], "a" is [a] and [ a], all ids inside the tiny model's head. A word the
    model cannot spell is dropped (here: ids past its 512-token head)."""
    token_ids = llm.engine.input_processor.sampling_token_ids
    assert token_ids(SamplingParams(bad_words=["inon"])) == [[258, 263], [304, 263]]
    assert token_ids(SamplingParams(bad_words=["a", " inon"])) == [[64], [264], [258, 263],
                                                                   [304, 263]]
    assert token_ids(SamplingParams(bad_words=["hello world"])) == []


def bigrams(tokens):
    return set(zip(tokens, tokens[1:]))


def test_bad_words_through_generate(llm):
    """Sampling over two tokens, "in" and "on": without bad_words "in" is followed by "on"
    somewhere; with bad_words=["inon"] never, while both tokens still appear. A one-token word never
    appears, even forced."""
    two = dict(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True,
               allowed_token_ids=[258, 263])
    free, banned, forced = generate_each(
        llm, two, dict(two, bad_words=["inon"]),
        dict(logit_bias={64: 100, 264: 100}, bad_words=["a"], max_tokens=8))
    assert (258, 263) in bigrams(free.token_ids)
    assert (258, 263) not in bigrams(banned.token_ids) and set(banned.token_ids) == {258, 263}
    assert not {64, 264} & set(forced.token_ids) and len(forced.token_ids) == 8


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={512: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[3, 512]), "allowed_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused_by_name(llm, kwargs, field):
    with pytest.raises(RequestError,
                       match=rf"SamplingParams\.{field} has token ids outside the vocabulary"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={3: 101}), "logit_bias"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logit_bias={3: "1"}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(allowed_token_ids=["1"]), "allowed_token_ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words=[3]), "bad_words"),
    (dict(bad_words=5), "bad_words"),
])
def test_sampling_params_refuse_bad_token_options_by_name(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_normalize_token_options():
    p = SamplingParams(logit_bias={"5": 1, 7: -100}, allowed_token_ids=(1, 2), bad_words="word")
    assert p.logit_bias == {5: 1.0, 7: -100.0
                            } and p.allowed_token_ids == [1, 2] and p.bad_words == ["word"]
    assert SamplingParams().logit_bias is None and SamplingParams().allowed_token_ids is None
