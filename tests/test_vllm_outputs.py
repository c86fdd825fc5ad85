"""vLLM's output shapes and everyday LLM surface, read the way vLLM's documented code reads them:
Logprob objects (logprob, rank, decoded_token), cumulative_logprob, RequestOutput.metrics,
LLM.get_tokenizer, raw logprobs under a grammar (one rule for every request), and ECMA-262 regex
classes (\\d is [0-9], \\w is [A-Za-z0-9_])."""
import math

import pytest
import torch

from vlinfer import LLM, Logprob, SamplingParams
from vlinfer.sampling_params import StructuredOutputsParams
from vlinfer.structured.ecma_regex import ascii_classes, ascii_schema


@pytest.fixture(scope="module")
def llm(qwen3_checkpoint):
    return LLM(qwen3_checkpoint[0], dtype="float32", kv_cache_bytes=4 * 2 ** 20, max_model_len=128)


def test_logprobs_are_objects_with_rank_and_decoded_token(llm):
    out = llm.generate([[5, 6, 7, 8]],
                       SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.engine.tokenizer and tokenizer.decode(out.token_ids) == out.text
    for token, entry in zip(out.token_ids, out.logprobs):
        chosen = entry[token]
        # greedy takes the most likely token
        assert isinstance(chosen, Logprob) and chosen.rank == 1
        assert chosen.decoded_token == tokenizer.decode([token]) and chosen.logprob <= 0
        assert sorted(e.rank for e in entry.values()) == [1, 2]
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    plain = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=2),
                         use_tqdm=False)[0].outputs[0]
    # vLLM: only when logprobs is asked
    assert plain.logprobs is None and plain.cumulative_logprob is None


def check_prompt_logprobs(out, prompt: list[int], k: int, model, tokenizer) -> None:
    """vLLM's prompt_logprobs: None first, then per prompt token {token: Logprob} holding that token
    and the k most likely, each value transformers' log_softmax of the raw logits at the position
    before (float32, 1e-4)."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for position, (token, entry) in enumerate(zip(prompt[1:], entries[1:]), 1):
        row = ref[position - 1]
        assert set(entry) == set(row.topk(k).indices.tolist() if k else []) | {token}, position
        for t, value in entry.items():
            assert abs(value.logprob - row[t].item()) < 1e-4, (position, t)
            assert value.decoded_token == tokenizer.decode([t])
        assert int((row > row[token] + 1e-4).sum()) <= entry[token].rank - 1 <= int(
            (row > row[token] - 1e-4).sum())


def test_prompt_logprobs_match_transformers(qwen3_checkpoint):
    """Through chunked prefill (8-token chunks over a 21-token prompt) and after the same prompt was
    cached: a prefix-cache hit would skip the positions whose logprobs are asked, so such a request
    reads no cached KV."""
    path, model = qwen3_checkpoint
    llm = LLM(path, dtype="float32", kv_cache_bytes=4 * 2**20, max_model_len=128,
              max_num_batched_tokens=8, enable_prefix_caching=True)
    prompt = [(7 * i + 3) % 200 + 1 for i in range(21)]
    warm = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert warm.prompt_logprobs is None  # not asked
    for k in (3, 0):
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k, n=2, seed=1)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0 and len(out.outputs) == 2
        check_prompt_logprobs(out, prompt, k, model, llm.get_tokenizer())
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the cache still serves requests that do not ask


def test_metrics_say_when_the_request_arrived_started_and_finished(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time \
        == m.finished_time
    assert m.time_in_queue >= 0


def test_logprobs_under_a_grammar_are_raw(llm):
    """The same request with and without a grammar: the logprobs of the first step are the same raw
    values (the grammar mask is not in them), finite even for tokens the grammar forbids; only the
    chosen token differs."""
    prompt = [[5, 6, 7, 8]]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                        use_tqdm=False)[0]
    constrained = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        use_tqdm=False)[0]
    free_entry, entry = free.outputs[0].logprobs[0], constrained.outputs[0].logprobs[0]
    assert all(math.isfinite(e.logprob) for e in entry.values())
    for token in set(free_entry) & set(entry):
        assert entry[token].logprob == pytest.approx(free_entry[token].logprob, abs=1e-5)
        assert entry[token].rank == free_entry[token].rank
    assert constrained.outputs[0].text in ("yes", "no", "y", "n") \
        or "yes".startswith(constrained.outputs[0].text) \
        or "no".startswith(constrained.outputs[0].text)


@pytest.mark.parametrize("regex, ascii", [
    (r"\d{4}-\d{2}-\d{2}", "[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    (r"\w+@\w+\.com\n", r"[A-Za-z0-9_]+@[A-Za-z0-9_]+\.com\n"),
    (r"[\d.]+\D\W", r"[0-9.]+[^0-9][^A-Za-z0-9_]"),
    (r"[^\w\s]", r"[^A-Za-z0-9_\s]"),
    (r"\\d\p{L}\s", r"\\d\p{L}\s"),  # an escaped backslash, a Unicode class and \s are left alone
])
def test_regex_classes_are_ascii(regex, ascii):
    assert ascii_classes(regex) == ascii


def test_schema_patterns_are_ascii():
    schema = {
        "type": "object", "properties": {"date": {"type": "string", "pattern": r"^\d{4}$"}},
        "patternProperties": {r"^\w+$": {"type": "string", "pattern": r"\d"}}, "enum": [r"\d"]
    }
    out = ascii_schema(schema)
    assert out["properties"]["date"]["pattern"] == "^[0-9]{4}$"
    assert out["patternProperties"] == {"^[A-Za-z0-9_]+$": {"type": "string", "pattern": "[0-9]"}}
    # values, not patterns
    assert out["enum"] == [r"\d"] and schema["properties"]["date"]["pattern"] == r"^\d{4}$"


@pytest.fixture(scope="module")
def full_vocab():
    """qwen3-vl-tiny: random weights over the real Qwen3 vocabulary, fullwidth digits included."""
    return LLM("qwen3-vl-tiny", dtype="float32", max_model_len=256, kv_cache_bytes=16 << 20)


def test_a_unicode_digit_is_not_a_digit(full_vocab):
    """Fullwidth digit tokens (Unicode Nd) pushed to the top by logit_bias: \\d must still only take
    0-9, as ECMA-262 (and JSON Schema's pattern) mean it, in a regex and in a schema pattern alike.
    """
    llm = full_vocab
    tokenizer = llm.get_tokenizer()
    # Nd, not ASCII
    fullwidth = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c)) for c in "１２３"]
    fullwidth = [ids[0] for ids in fullwidth if len(ids) == 1]
    assert fullwidth, "the tokenizer has no single-token fullwidth digit to test with"
    bias = {token: 100.0 for token in fullwidth}
    for constraint in (StructuredOutputsParams(regex=r"\d{3}"),
                       StructuredOutputsParams(json={"type": "string", "pattern": r"^\d{3}$"})):
        out = llm.generate([[5, 6, 7]],
                           SamplingParams(temperature=0, max_tokens=8, logit_bias=bias,
                                          structured_outputs=constraint), use_tqdm=False)[0]
        text = out.outputs[0].text.strip('"')
        assert len(text) == 3 and all(c in "0123456789" for c in text), out.outputs[0].text
