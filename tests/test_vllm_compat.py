"""vLLM's SamplingParams fields with vLLM's semantics, through LLM.generate / LLM.chat / LLMEngine:
n completions with their own seed streams, skip_special_tokens, spaces_between_special_tokens,
include_stop_str_in_output, truncate_prompt_tokens; unsupported vLLM fields refused by name;
image_url.detail in chat."""
import base64
import dataclasses
import io
import logging
import os
import re

import numpy as np
import PIL.Image
import pytest

from dependencies import REPO, qwen_tokenizer_dir

from engine_checks import assert_block_pool_empty

from text_checkpoints import build_checkpoint, tiny_text_config
from vlinfer import LLM, Pipeline, SamplingParams
from vlinfer.config import EngineConfig
from vlinfer.outputs import RequestError
from vlinfer import vllm_names

SAMPLE = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def text_llm(qwen3_checkpoint):
    """A tiny random Qwen3 with the real Qwen tokenizer (vocabulary 512, so its tokens are
    byte-level text)."""
    return LLM(qwen3_checkpoint[0], dtype="float32", max_model_len=256, kv_cache_bytes=16 << 20)


def wordpiece_tokenizer():
    """512 tokens whose WordPiece decoder puts a space between every two tokens, added ones
    included: 400 words, 56 added tokens <aN> and 56 special ones <sN> (the decoders of byte-level
    BPE tokenizers, Qwen's and SmolLM2's, put none, so spaces_between_special_tokens cannot show on
    them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(399)}}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.add_tokens([f"<a{i}>" for i in range(56)])
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<s{i}>" for i in range(56)]})
    assert len(tokenizer) == 512
    return tokenizer


@pytest.fixture(scope="module")
def wordpiece_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("wordpiece")
    build_checkpoint(str(path), tiny_text_config("llama", False))
    for name in os.listdir(qwen_tokenizer_dir()):
        os.remove(path / name)
    wordpiece_tokenizer().save_pretrained(str(path))
    return LLM(str(path), dtype="float32", max_model_len=256, kv_cache_bytes=16 << 20)


@pytest.fixture(scope="module")
def vl_llm():
    return LLM("qwen3-vl-tiny", dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)


def picture(h: int, w: int, seed: int = 0) -> PIL.Image.Image:
    return PIL.Image.fromarray((np.random.default_rng(seed).random(
        (h, w, 3)) * 255).astype("uint8"))


def data_uri(image: PIL.Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# -------------------------------------------------------------------------------------
# SamplingParams fields

@pytest.mark.parametrize("kwargs, names", [
    (dict(best_of=3), ["SamplingParams.best_of=3 is not supported"]),
    (dict(use_beam_search=True), ["SamplingParams.use_beam_search=True"]),
    (dict(guided_decoding={"json": {}}),
     ["SamplingParams.guided_decoding is vLLM's older name", "use structured_outputs="]),
    (dict(early_stopping=True, length_penalty=0.5),
     ["SamplingParams.early_stopping=True", "SamplingParams.length_penalty=0.5"]),
    (dict(prompt_logprobs=21), ["SamplingParams.prompt_logprobs must be None or an int in [0, 20]"
                                ]),
    (dict(logits_processors=[print]), ["SamplingParams.logits_processors="]),
    (dict(n=2, best_of=3), ["SamplingParams.best_of=3"]),
    (dict(temprature=0.5), ["no field 'temprature'", "did you mean 'temperature'"]),
    (dict(top_k=5, frobnicate=1), ["no field 'frobnicate'"]),
])
def test_unsupported_fields_are_value_errors_naming_them(kwargs, names):
    with pytest.raises(ValueError) as e:  # never the dataclass's bare TypeError
        SamplingParams(**kwargs)
    for name in names:
        assert name in str(e.value)


def test_vllm_fields_at_their_off_value_are_accepted():
    # What vLLM code that spells out every field passes: the off values mean nothing to do.
    p = SamplingParams(n=2, best_of=2, use_beam_search=False, length_penalty=1.0,
                       early_stopping=False, guided_decoding=None, logits_processors=[],
                       detokenize=True, skip_special_tokens=False,
                       spaces_between_special_tokens=False, include_stop_str_in_output=True,
                       truncate_prompt_tokens=-1, temperature=0.5)
    assert (p.n, p.skip_special_tokens, p.spaces_between_special_tokens,
            p.include_stop_str_in_output, p.truncate_prompt_tokens,
            p.temperature) == (2, False, False, True, -1, 0.5)
    assert SamplingParams().n == 1 and SamplingParams().skip_special_tokens and \
        SamplingParams().spaces_between_special_tokens and \
        not SamplingParams().include_stop_str_in_output
    with pytest.raises(ValueError, match="use_beam_search=0"):  # not False, only equal to it
        SamplingParams(use_beam_search=0)


def test_max_tokens_none_means_until_the_context_ends(text_llm):
    """vLLM's max_tokens=None: no limit of its own, the context (max_model_len) ends it."""
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)
    out = text_llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 256
    with pytest.raises(ValueError, match="max_tokens must be None"):
        SamplingParams(max_tokens=0)


# -------------------------------------------------------------------------------------
# vLLM's engine keywords (vlinfer/vllm_names.py)

def test_vllm_engine_keywords_work_with_their_meaning(qwen3_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(model=qwen3_checkpoint[0], dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=16 << 20, gpu_memory_utilization=0.5, block_size=16,
                  trust_remote_code=True, swap_space=4, cpu_offload_gb=0, seed=1,
                  enforce_eager=True, tokenizer=None, pipeline_parallel_size=1,
                  disable_log_stats=True)
    with llm:
        config = llm.engine.config
        assert (config.memory_utilization, config.kvcache_block_size, config.kv_cache_bytes,
                config.seed) == (0.5, 16, 16 << 20, 1)
        assert "never runs a checkpoint's remote code" in caplog.text
        assert "swap_space=4: does nothing here" in caplog.text
        assert "cpu_offload_gb=0: does nothing here" in caplog.text
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, says", [
    (dict(pipeline_parallel_size=2), ["pipeline_parallel_size=2 is not supported",
                                      "use tensor_parallel_size"]),
    (dict(tokenizer="other", revision="main"), ["tokenizer='other'", "revision='main'",
                                                "pass its path"]),
    (dict(gpu_memory_utilisation=0.5), ["no option 'gpu_memory_utilisation'",
                                        "did you mean 'gpu_memory_utilization'"]),
    (dict(max_num_seq=8), ["did you mean 'max_num_seqs'"]),
    (dict(rope_scaling={"type": "yarn"}), ["use hf_overrides"]),
    (dict(gpu_memory_utilization=0.5, memory_utilization=0.4), ["the same option"]),
    (dict(max_logprobs=True), ["max_logprobs=True is not supported"]),  # True is not 20
])
@pytest.mark.parametrize("surface", [LLM, Pipeline])
def test_vllm_engine_keywords_refused_by_name_before_loading(surface, kwargs, says):
    """A ValueError naming each keyword, why and what to use, before any model is looked for (the
    model does not exist), through LLM and Pipeline alike; never a bare TypeError."""
    with pytest.raises(ValueError) as e:
        surface("no-such-model-anywhere", **kwargs)
    for text in says:
        assert text in str(e.value)


def test_vllm_engine_keyword_tables_are_consistent():
    ours = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(vllm_names.SAME) <= ours
    assert set(vllm_names.ALIASES.values()) <= ours
    others = [*vllm_names.ALIASES, *vllm_names.NO_EFFECT, *vllm_names.ONLY]
    assert len(others) == len(set(others)) and not set(others) & ours


def test_python_api_doc_tables_every_vllm_engine_keyword():
    """docs/python-api.md's table has one row per vLLM keyword the code knows, and no other."""
    text = open(os.path.join(REPO, "docs", "python-api.md")).read()
    table = text.split("### vLLM's engine keywords", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)`", table, re.M)
    known = [*vllm_names.SAME, *vllm_names.ALIASES, *vllm_names.NO_EFFECT, *vllm_names.ONLY]
    assert sorted(rows) == sorted(known)


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(n=1.5), "n"), (dict(n=True), "n"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
    (dict(spaces_between_special_tokens=None), "spaces_between_special_tokens"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=2.5), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens"),
])
def test_new_fields_are_validated(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_for_completion_seeds():
    p = SamplingParams(n=3, seed=5, temperature=0.7)
    assert [(c.n, c.seed, c.temperature) for c in map(p.for_completion, range(3))] == \
        [(1, 5, 0.7), (1, 6, 0.7), (1, 7, 0.7)]
    assert SamplingParams(n=2).for_completion(1).seed is None
    # wraps inside the valid range
    assert SamplingParams(seed=2 ** 63 - 1).for_completion(1).seed == -2 ** 63


# -------------------------------------------------------------------------------------------------
# n

def test_n_completions_each_with_its_own_seed_stream(text_llm):
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79]]
    params = SamplingParams(n=3, seed=11, **SAMPLE)
    outs = text_llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt and [c.index for c in out.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # three different draws
        # completion i is the single run seeded seed + i
        for i, completion in enumerate(out.outputs):
            alone = text_llm.generate(prompt, SamplingParams(seed=11 + i, **SAMPLE),
                                      use_tqdm=False)[0].outputs
            assert len(alone) == 1 and alone[0].token_ids == completion.token_ids
            assert alone[0].text == completion.text
    again = text_llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs]
                                                                 for o in outs]
    unseeded = text_llm.generate(prompts[0], SamplingParams(n=4, **SAMPLE), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) == 4
    assert_block_pool_empty(text_llm)


def test_n_mixes_with_other_requests_and_rejections(text_llm):
    params = [
        SamplingParams(n=2, seed=1, **SAMPLE),
        SamplingParams(seed=1, **SAMPLE),
        SamplingParams(n=3, **SAMPLE)
    ]
    with pytest.raises(RequestError, match="request 2: the prompt is empty") as e:
        text_llm.generate([[7, 8, 9], [7, 8, 9], []], params, use_tqdm=False)
    two, one, rejected = e.value.outputs
    assert [c.index for c in two.outputs] == [0, 1] and len(one.outputs) == 1 and rejected.error
    # completion 0 keeps the seed itself
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
    assert two.outputs[1].token_ids != one.outputs[0].token_ids
    assert_block_pool_empty(text_llm)


def test_engine_streams_n_completions_under_one_request_id(text_llm):
    engine = text_llm.engine
    params = SamplingParams(n=2, seed=3, **SAMPLE)
    request_id = engine.add_request([5, 6, 7], params)
    pieces, finals = {0: [], 1: []}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id and len(out.outputs) == 1
            completion = out.outputs[0]
            pieces[completion.index].append(completion.delta_text)
            if out.finished:
                finals[completion.index] = completion
    assert sorted(finals) == [0, 1]
    assert all("".join(pieces[i]) == finals[i].text for i in (0, 1))
    batch = text_llm.generate([5, 6, 7], params, use_tqdm=False)[0]
    assert [c.token_ids for c in batch.outputs] == [finals[0].token_ids, finals[1].token_ids]
    request_id = engine.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.abort_request(request_id)  # the request's id stops all three
    assert_block_pool_empty(text_llm)
    # the one-sequence call says where n runs
    with pytest.raises(ValueError, match=r"SamplingParams\.n=2"):
        engine.make_sequence([1, 2], SamplingParams(n=2))


def test_chat_n_with_an_image(vl_llm):
    messages = [{
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": data_uri(picture(64, 96))}},
                    {"type": "text", "text": "Describe it."}]
    }]
    out = vl_llm.chat(messages, SamplingParams(n=2, seed=4, **SAMPLE), use_tqdm=False)[0]
    assert [c.index
            for c in out.outputs] == [0, 1] and out.outputs[0].token_ids != out.outputs[1].token_ids
    assert out.images == [{"size": [224, 320], "num_tokens": 70}]
    alone = vl_llm.chat(messages, SamplingParams(seed=5, **SAMPLE), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == out.outputs[1].token_ids
    assert alone.prompt_token_ids == out.prompt_token_ids
    assert_block_pool_empty(vl_llm)


# ------------------------------------------------------------------------------------------ special
# tokens

def test_special_tokens_and_the_spaces_between_them(wordpiece_llm):
    tok = wordpiece_llm.tokenizer
    added, special = set(tok.added_tokens_decoder), set(tok.all_special_ids)
    runs = {(skip, spaces): wordpiece_llm.generate([5, 6, 7], SamplingParams(
        n=2, seed=0, temperature=1.0, max_tokens=64, ignore_eos=True, skip_special_tokens=skip,
        spaces_between_special_tokens=spaces), use_tqdm=False)[0]
        for skip in (True, False) for spaces in (True, False)}
    ids = [c.token_ids for c in runs[True, True].outputs]
    # text changes, tokens do not
    assert all([c.token_ids for c in run.outputs] == ids for run in runs.values())
    assert ids[0] != ids[1]
    adjacent_added = [any(a in added and b in added for a, b in zip(seq, seq[1:])) for seq in ids]
    # what the checks below need
    assert any(t in special for seq in ids for t in seq) and any(adjacent_added)
    for i, seq in enumerate(ids):
        tokens = tok.convert_ids_to_tokens(seq)
        # WordPiece puts a space before every token (the prompt ends in a word, so before the first
        # one too).
        skipped = "".join(" " + t for t, t_id in zip(tokens, seq) if t_id not in special)
        kept = "".join(" " + t for t in tokens)
        no_spaces = "".join(("" if j and seq[j - 1] in added and seq[j] in added else " ") + t
                            for j, t in enumerate(tokens))
        assert runs[True, True].outputs[i].text == skipped == tok.decode(
            [7] + seq, skip_special_tokens=True)[2:]
        # vLLM: only kept special tokens lose their spaces
        assert runs[True, False].outputs[i].text == skipped
        assert runs[False, True].outputs[i].text == kept
        assert runs[False, False].outputs[i].text == no_spaces
        assert (no_spaces != kept) == adjacent_added[i]
    assert_block_pool_empty(wordpiece_llm)


@pytest.mark.slow  # the real SmolLM2
def test_real_model_special_tokens_and_the_eos_text():
    """SmolLM2 answers, then says <|im_end|> (its EOS): kept or skipped in the text as asked; when
    it ends the request, its text is left out unless include_stop_str_in_output, as vLLM does."""
    llm = LLM("smollm2", dtype="float32", kv_cache_bytes=64 << 20, max_model_len=512)
    tok, eos = llm.tokenizer, llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]

    def run(**options):
        return llm.chat(chat, SamplingParams(temperature=0, max_tokens=32, **options),
                        use_tqdm=False)[0].outputs[0]

    kept, skipped = run(ignore_eos=True, skip_special_tokens=False), run(ignore_eos=True)
    # it went on past its answer
    assert eos in kept.token_ids and kept.token_ids == skipped.token_ids
    assert "<|im_end|>" in kept.text and kept.text == tok.decode(kept.token_ids,
                                                                 skip_special_tokens=False)
    assert "<|im_end|>" not in skipped.text and skipped.text == tok.decode(
        kept.token_ids, skip_special_tokens=True)
    assert "Paris" in skipped.text
    stopped = run(skip_special_tokens=False)
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos
    assert stopped.text == tok.decode(stopped.token_ids[:-1], skip_special_tokens=False)
    assert "<|im_end|>" not in stopped.text
    assert run(skip_special_tokens=False,
               include_stop_str_in_output=True).text == stopped.text + "<|im_end|>"
    assert run().text == stopped.text  # skipped anyway


# ------------------------------------------------------------------------------
# include_stop_str_in_output

def test_include_stop_str_in_output(text_llm):
    prompt = [11, 12, 13]
    full = text_llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    stop = full.text[8:11]
    start = full.text.find(stop)
    assert len(stop) == 3 and start >= 0

    def run(**options):
        return text_llm.generate(prompt, SamplingParams(**GREEDY, stop=[stop], **options),
                                 use_tqdm=False)[0]

    without, with_stop = run().outputs[0], run(include_stop_str_in_output=True).outputs[0]
    assert without.text == full.text[:start] and without.finish_reason == "stop" \
        and without.stop_reason == stop
    assert with_stop.text == full.text[:start + len(stop)] and with_stop.stop_reason == stop
    engine = text_llm.engine  # streamed: nothing held back that the final text then contradicts
    request_id = engine.add_request(
        prompt, SamplingParams(**GREEDY, stop=[stop], include_stop_str_in_output=True))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [
            out.outputs[0].delta_text for out in engine.step() if out.request_id == request_id
        ]
    assert "".join(pieces) == with_stop.text

    # A stop token: its text is left out unless asked for, as for EOS.
    tok = text_llm.tokenizer
    j = next(j for j in range(2, 24) if full.token_ids[j] not in full.token_ids[:j] and
             tok.decode([full.token_ids[j]]).strip().isalnum())
    stop_id = full.token_ids[j]

    def upto(k):
        return text_llm.generate(prompt, SamplingParams(**{**GREEDY, "max_tokens": k}),
                                 use_tqdm=False)[0].outputs[0]

    without = text_llm.generate(prompt, SamplingParams(**GREEDY, stop_token_ids=[stop_id]),
                                use_tqdm=False)
    with_stop = text_llm.generate(
        prompt, SamplingParams(**GREEDY, stop_token_ids=[stop_id], include_stop_str_in_output=True),
        use_tqdm=False)
    assert without[0].outputs[0].token_ids == with_stop[0].outputs[
        0].token_ids == full.token_ids[:j + 1]
    assert without[0].outputs[0].stop_reason == stop_id
    assert without[0].outputs[0].text == upto(j).text != upto(
        j + 1).text == with_stop[0].outputs[0].text
    assert_block_pool_empty(text_llm)


# ----------------------------------------------------------------------------------
# truncate_prompt_tokens

def test_truncate_prompt_tokens_keeps_the_last_k(text_llm):
    prompt = list(range(20, 50))
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    cut = text_llm.generate(prompt, SamplingParams(**greedy, truncate_prompt_tokens=7),
                            use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-7:]
    direct = text_llm.generate(prompt[-7:], SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = text_llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0]
    assert whole.outputs[0].token_ids != cut.outputs[0].token_ids  # the cut tokens mattered
    # longer than the prompt: nothing to cut
    assert text_llm.generate(prompt, SamplingParams(**greedy, truncate_prompt_tokens=100),
                             use_tqdm=False)[0].prompt_token_ids == prompt
    limit = text_llm.engine.max_model_len
    long = [(7 * i) % 500 + 3 for i in range(limit + 10)]
    with pytest.raises(RequestError, match="more than max_model_len"):
        text_llm.generate(long, SamplingParams(**greedy), use_tqdm=False)
    fitted = text_llm.generate(long, SamplingParams(**greedy, truncate_prompt_tokens=-1),
                               use_tqdm=False)[0]
    assert fitted.prompt_token_ids == long[-limit:] and fitted.outputs[0].finish_reason == "length"
    assert_block_pool_empty(text_llm)


def test_truncation_decodes_and_preprocesses_each_image_once(vl_llm, monkeypatch):
    """A cut prompt is re-expanded over the pixels already preprocessed: one decode, one
    preprocessing."""
    from vlinfer.multimodal import processor as mm_module
    tok, mm = vl_llm.tokenizer, vl_llm.engine.input_processor.mm_processor
    vision = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    ids = tok("A preamble to be cut. " * 4).input_ids + vision + tok(" Describe it.").input_ids
    calls = {"decode": 0, "preprocess": 0}
    load_image, preprocess = mm_module.load_image, mm.image_processor

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(mm_module, "load_image", counted("decode", load_image))
    monkeypatch.setattr(mm, "image_processor", counted("preprocess", preprocess))
    full = vl_llm.engine.make_sequence(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": [picture(64, 64)]}})
    calls.update(decode=0, preprocess=0)
    cut = vl_llm.engine.make_sequence(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": [picture(64, 64)]}},
        SamplingParams(truncate_prompt_tokens=full.num_prompt_tokens - 10))
    assert cut.token_ids == full.token_ids[10:]
    assert calls == {"decode": 1, "preprocess": 1}


def test_truncate_prompt_tokens_with_an_image(vl_llm):
    tok, engine = vl_llm.tokenizer, vl_llm.engine
    vision = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    head, tail = tok("A preamble to be cut. " * 4).input_ids, tok(" Describe it.").input_ids
    prompt_ids = head + vision + tail
    image = picture(64, 64, seed=2)  # 64 placeholders at the minimum 256x256

    def request(ids):
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}

    def params(k=None):
        return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                              truncate_prompt_tokens=k)

    full = vl_llm.generate(request(prompt_ids), params(), use_tqdm=False)[0]
    keep = len(full.prompt_token_ids) - 10
    cut = vl_llm.generate(request(prompt_ids), params(keep), use_tqdm=False)[0]
    direct = vl_llm.generate(request(prompt_ids[10:]), params(), use_tqdm=False)[0]
    assert cut.prompt_token_ids == full.prompt_token_ids[-keep:] == direct.prompt_token_ids
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    a, b = engine.make_sequence(request(prompt_ids),
                                params(keep)), engine.make_sequence(request(prompt_ids[10:]))
    assert [(i.offset, i.length) for i in a.mm_items] == [(i.offset, i.length) for i in b.mm_items]
    assert a.mrope_positions.tolist() == b.mrope_positions.tolist()
    assert a.mrope_position_delta == b.mrope_position_delta
    with pytest.raises(RequestError, match=r"truncate_prompt_tokens=\d+ .* cuts into image 0"):
        vl_llm.generate(request(prompt_ids), params(len(tail) + 10), use_tqdm=False)
    assert_block_pool_empty(vl_llm)


# ---------------------------------------------------------------------------------------- image
# detail

def test_image_detail_sets_the_pixel_budget(vl_llm):
    big = picture(800, 800, seed=3)

    def seen(part, **kwargs):
        out = vl_llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "Hi."}]}],
                          SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, **kwargs)[0]
        return out.images[0]

    def image_url(detail=None):
        return {
            "type": "image_url",
            "image_url": {"url": data_uri(big), **({"detail": detail} if detail else {})}
        }

    # low: at most 512 x 512 pixels (256 tokens); high and auto: the model's own budget (800 x 800,
    # 625 tokens).
    assert seen(image_url("low")) == {"size": [512, 512], "num_tokens": 256}
    assert seen(image_url("high")) == seen(image_url("auto")) == seen(image_url()) == \
        {"size": [800, 800], "num_tokens": 625}
    # vlinfer's own image part takes the same key; a smaller per-request max_pixels still wins.
    assert seen({"type": "image", "image": big,
                 "detail": "low"}) == {"size": [512, 512], "num_tokens": 256}
    assert seen({"type": "image", "image": big, "detail": "low"},
                mm_processor_kwargs={"max_pixels": 256 * 256
                                     }) == {"size": [256, 256], "num_tokens": 64}
    with pytest.raises(RequestError, match="detail must be one of auto, low, high, got 'medium'"):
        seen(image_url("medium"))


def test_max_pixels_bounds_an_image_below_min_pixels(vl_llm):
    # 40x40 is far below min_pixels (256x256): it is scaled up, but never past max_pixels.
    out = vl_llm.generate(
        {
            "prompt_token_ids": vl_llm.tokenizer(
                "<|vision_start|><|image_pad|><|vision_end|>Hi").input_ids, "multi_modal_data": {
                    "image": [picture(40, 40)]
                }, "mm_processor_kwargs": {"max_pixels": 128 * 128}
        }, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    h, w = out.images[0]["size"]
    assert h * w <= 128 * 128 and (h, w) == (128, 128)
