"""The Pipeline API (every call form, streaming, captioning, sampling options), model resolution and
its errors, and chat templates against transformers' apply_chat_template. Two models, each loaded
once: the embedded tiny Qwen3-VL (meaningless words, real mechanics; greedy, so answers can be
compared) and the real SmolLM2."""
import base64
import io
import logging
from importlib import resources

import numpy as np
import pytest
from PIL import Image

from vlinfer import ModelNotFoundError, Pipeline, RequestError, SamplingParams
from vlinfer.loading import known_aliases, resolve_model

GREEDY = dict(temperature=0, max_tokens=6)
PUBLISHED_ONE_IMAGE = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
    "<|im_start|>assistant\n")


def picture(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    base = rng.randint(0, 255, (1, 1, 3)) + np.linspace(0, 80, w)[None, :, None] + rng.randint(
        0, 50, (h, w, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


A, B, C = picture(64, 64, 1), picture(48, 80, 2), picture(72, 56, 3)


def data_uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


@pytest.fixture(scope="module")
def vl():
    return Pipeline("qwen3-vl-tiny", max_model_len=1024, kv_cache_bytes=32 * 2 ** 20)


@pytest.fixture(scope="module")
def text():
    return Pipeline("smollm2", max_model_len=1024, kv_cache_bytes=64 * 2 ** 20)


# ---- the vision pipeline ----
def test_call_forms_agree(vl):
    one = vl(A, "Describe this image.", **GREEDY)
    # The engine's greedy answer to the published one-image prompt (itself checked against
    # transformers in test_qwen3_vl_engine.py), its six tokens decoded.
    ref = vl.llm.generate({"prompt": PUBLISHED_ONE_IMAGE, "multi_modal_data": {"image": [A]}},
                          SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert one == ref.text and one == vl.llm.tokenizer.decode(ref.token_ids,
                                                              skip_special_tokens=True)
    assert len(ref.token_ids) == 6 or ref.finish_reason == "stop"
    assert one == vl.chat(
        user({"type": "image", "image": A}, {"type": "text", "text": "Describe this image."}),
        **GREEDY)
    two = vl(images=[A, B], prompt="Compare them.", **GREEDY)
    assert two == vl.chat(user({"type": "image", "image": A}, {"type": "image", "image": B},
                               {"type": "text", "text": "Compare them."}), **GREEDY)
    # image= and images= together, in order
    assert vl(A, images=[B], prompt="Compare them.", **GREEDY) == two
    out = vl.llm.chat(vl.messages("Compare them.", [A, B]), SamplingParams(**GREEDY),
                      use_tqdm=False)[0]
    assert out.outputs[0].text == two and len(out.images) == 2  # the engine saw both images


def test_image_and_image_url_parts(vl):
    """The same pixels as a PIL image, a data URI (OpenAI image_url part) or a file path give the
    same answer."""
    as_pil = vl.chat(user({"type": "image", "image": A}, {"type": "text", "text": "What is this?"}),
                     **GREEDY)
    as_uri = vl.chat(user({"type": "image_url", "image_url": {"url": data_uri(A)}},
                          {"type": "text", "text": "What is this?"}), **GREEDY)
    assert as_pil == as_uri
    mixed = [{"role": "system", "content": "Be brief."}, {
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(B)}},
                                    {"type": "image",
                                     "image": C}, {"type": "text", "text": "And these?"}]
    }]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{image}{image}And "
        "these?<|im_end|>\n"
        "<|im_start|>assistant\n")
    # both images, in order, after the system turn
    assert vl.engine.chat_prompt(mixed)["prompt"] == prompt
    ref = vl.llm.generate({"prompt": prompt, "multi_modal_data": {"image": [B, C]}},
                          SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert vl.chat(mixed, **GREEDY) == ref.outputs[0].text


def test_stream_joins_to_the_greedy_answer(vl):
    deltas = list(vl.stream(A, "Describe this image.", temperature=0, max_tokens=12))
    assert len(deltas) > 1
    assert "".join(deltas) == vl(A, "Describe this image.", temperature=0, max_tokens=12)
    # Leaving early aborts the request: nothing stays scheduled or holds blocks.
    for _ in vl.stream(images=[B], prompt="Go on.", temperature=0, max_tokens=50):
        break
    assert not vl.engine.requests and not vl.engine.has_unfinished_requests()


def test_stream_with_n_keeps_each_completion_apart(vl):
    """n > 1: (index, delta) pairs; joined per index, each equals that completion of the same seeded
    request run whole, and the stream ends only when all n are done."""
    params = dict(temperature=1.0, seed=3, max_tokens=10, n=3, ignore_eos=True)
    texts = {}
    for index, delta in vl.stream(A, "Describe this image.", **params):
        texts[index] = texts.get(index, "") + delta
    whole = vl.llm.chat(vl.messages("Describe this image.", [A]), vl.sampling_params(**params),
                        use_tqdm=False)[0]
    assert texts == {c.index: c.text for c in whole.outputs} and len(set(texts.values())) > 1
    assert not vl.engine.requests


def test_caption_in_order_equals_single_calls(vl):
    captions = vl.caption([A, B, C], batch_size=2, **GREEDY)
    assert captions == [vl(x, "Describe this image.", **GREEDY) for x in (A, B, C)]
    # An unreadable image: the others are still captioned and come back in the error's outputs.
    with pytest.raises(RequestError, match=r"1 of 3 images could not be captioned.*images\[1\]"
                       ) as err:
        vl.caption([A, b"not an image", C], batch_size=3, **GREEDY)
    outs = err.value.outputs
    assert outs[1].error and [outs[0].outputs[0].text, outs[2].outputs[0].text
                              ] == [captions[0], captions[2]]
    assert err.value.captions == [captions[0], None, captions[2]]


def test_caption_takes_folders_globs_lists_and_records_errors_in_place(vl, tmp_path):
    """A string is a folder, a glob or a path, never its letters; a failure in one batch leaves
    the next batches running; errors="record" gives `vlinfer caption`'s records (fails today: the
    folder's name is captioned letter by letter, and the first failed batch ends the call)."""
    from vlinfer.caption_records import IMAGE_RECORD_FIELDS
    A.save(tmp_path / "a.png")
    B.save(tmp_path / "b.png")
    (tmp_path / "notes.md").write_text("not an image")
    expected = vl.caption([A, B], **GREEDY)
    assert vl.caption(str(tmp_path), **GREEDY) == expected
    assert vl.caption(str(tmp_path / "*.png"), **GREEDY) == expected
    assert vl.caption([tmp_path / "b.png"], **GREEDY) == expected[1:]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no image files"):
        vl.caption(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="no files match"):
        vl.caption(str(tmp_path / "none" / "*.png"))
    missing = str(tmp_path / "missing.png")
    with pytest.raises(RequestError) as err:  # batch_size 1: the failure is its own batch
        vl.caption([str(tmp_path / "a.png"), missing, B], batch_size=1, **GREEDY)
    assert err.value.captions == [expected[0], None, expected[1]]
    assert [name for name, _ in err.value.failures] == [missing]
    records = vl.caption([str(tmp_path / "a.png"), missing], errors="record", **GREEDY)
    assert [list(r) for r in records] == [list(IMAGE_RECORD_FIELDS)] * 2
    assert records[0]["caption"] == expected[0].strip() and records[0]["error"] is None
    assert records[1]["path"] == missing and records[1]["caption"] is None
    assert "missing.png" in records[1]["error"]


def test_call_forms_a_newcomer_tries(vl):
    """pipe(question), pipe(image) alone, n > 1 as a list, max_pixels as a keyword (each fails
    today: the question is read as an image path, an image alone gets no text, n=2 returns one
    string, max_pixels is "did you mean max_tokens?")."""
    question = vl("What is a house?", **GREEDY)
    assert question == vl.chat(user({"type": "text", "text": "What is a house?"}), **GREEDY)
    assert vl(A, **GREEDY) == vl(A, "Describe this image.", **GREEDY)
    with pytest.raises(ValueError, match="is not an image.*prompt="):
        vl("holiday-photo", "What is in it?")
    two = vl(A, "Describe.", n=2, temperature=1.0, seed=5, max_tokens=4)
    assert isinstance(two, list) and len(two) == 2 and all(isinstance(t, str) for t in two)
    small = dict(max_pixels=64 * 64, min_pixels=32 * 32)
    assert vl(B, "Describe.", **small, **GREEDY) == \
        vl(B, "Describe.", mm_processor_kwargs=small, **GREEDY)
    with pytest.raises(ValueError, match="max_pixels given both"):
        vl(B, "x", max_pixels=4096, mm_processor_kwargs={"max_pixels": 4096})


def test_transformers_task_form_and_help():
    """Pipeline(task, model=...) as transformers' pipeline(...); a model given twice is named
    before anything loads; help() shows how the arguments are read."""
    pipe = Pipeline("image-to-text", model="qwen3-vl-tiny", max_model_len=1024,
                    kv_cache_bytes=16 * 2 ** 20)
    with pipe.llm:
        assert (pipe.task, pipe.model, pipe.is_multimodal) == ("image-to-text", "qwen3-vl-tiny",
                                                               True)
    with pytest.raises(ValueError, match="give the model once"):
        Pipeline("qwen3-vl", model="smollm2")
    for method, words in ((Pipeline, "a first argument that is no image is the prompt"),
                          (Pipeline.__call__, "n > 1: a list"),
                          (Pipeline.caption, "errors=\"record\"")):
        assert words in (method.__doc__ or "")


def test_sampling_options_pass_through(vl, monkeypatch):
    seen = []
    real_chat = vl.llm.chat

    class Captured(Exception):
        pass

    def spy(messages, params, **kwargs):
        seen.append(params)
        # only look at the defaults; running 512 tokens would just cost time
        if params.max_tokens > 100:
            raise Captured
        return real_chat(messages, params, **kwargs)

    monkeypatch.setattr(vl.llm, "chat", spy)
    short = vl(A, "Describe this image.", max_tokens=3, temperature=0)
    assert (seen[-1].max_tokens, seen[-1].temperature) == (3, 0)
    assert len(vl.llm.tokenizer(short, add_special_tokens=False).input_ids) <= 3
    vl(A, "Describe.", temperature=0.8, top_p=0.5, top_k=7, seed=3, max_tokens=2)
    assert (seen[-1].temperature, seen[-1].top_p, seen[-1].top_k, seen[-1].seed) == (0.8, 0.5, 7, 3)
    with pytest.raises(Captured):
        vl(A, "Describe.")
    # Pipeline's defaults when none are given
    assert (seen[-1].max_tokens, seen[-1].temperature) == (512, 1.0)
    monkeypatch.undo()
    sampled = [vl(A, "Describe.", temperature=1.0, seed=11, max_tokens=8) for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded sampling repeats
    with pytest.raises(ValueError, match="not both"):
        vl(A, "x", sampling_params=SamplingParams(), max_tokens=3)
    with pytest.raises(ValueError, match="max_tokens"):
        vl(A, "x", max_tokens=0)
    with pytest.raises(ValueError, match="nothing to answer"):
        vl()


def test_qwen3_vl_template_is_the_published_layout(vl):
    shipped = resources.files("vlinfer.multimodal").joinpath("templates/qwen3_vl.jinja").read_text()
    messages = user({"type": "image", "image": A}, {"type": "text", "text": "Describe this image."})
    # the tiny checkpoint's tokenizer template has no vision tokens
    assert vl.engine.input_processor.chat_template == shipped
    assert vl.engine.chat_prompt(messages)["prompt"] == PUBLISHED_ONE_IMAGE
    template_messages = user({"type": "image"}, {"type": "text", "text": "Describe this image."})
    assert vl.llm.tokenizer.apply_chat_template(template_messages, chat_template=shipped,
                                                tokenize=False,
                                                add_generation_prompt=True) == PUBLISHED_ONE_IMAGE
    two = vl.engine.chat_prompt(
        [{"role": "system", "content": "Be brief."}] +
        user({"type": "text", "text": "Compare "}, {"type": "image", "image": A},
             {"type": "text", "text": " and "}, {"type": "image", "image": B}))["prompt"]
    assert two == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompare "
        "<|vision_start|><|image_pad|>"
        "<|vision_end|> and "
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )


# ---- the text pipeline ----
def test_text_pipeline_forms(text):
    question = "What is the capital of France? Answer in one sentence."
    answer = text(question, max_tokens=10, temperature=0)
    assert "Paris" in answer
    assert text.chat([{"role": "user", "content": question}], max_tokens=10,
                     temperature=0) == answer
    assert text(prompt=question, max_tokens=10, temperature=0) == answer
    deltas = list(text.stream(question, max_tokens=10, temperature=0))
    assert len(deltas) > 1 and "".join(deltas) == answer


def test_text_pipeline_rejects_images(text):
    with pytest.raises(ValueError, match="text-only model"):
        text(A, "What is this?")
    with pytest.raises(ValueError, match="text-only model"):
        text.chat(user({"type": "image", "image": A}, {"type": "text", "text": "What is this?"}))
    with pytest.raises(ValueError, match="text-only model"):
        text.caption([A])
    with pytest.raises(ValueError, match="text-only model"):
        next(text.stream(images=[A], prompt="What is this?"))


def test_smollm2_template_matches_transformers(text):
    """Our chat prompt equals transformers' apply_chat_template on the model's tokenizer, for plain
    strings and for OpenAI-style text parts (which we flatten to the string the template expects).
    """
    tokenizer = text.llm.tokenizer
    conversations = [
        [{"role": "user", "content": "hello"}],
        [{"role": "system",
          "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}],
    ]
    for messages in conversations:
        expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        prompt = text.engine.chat_prompt(messages)
        assert prompt["prompt"] == expected
        assert prompt["prompt_token_ids"] == tokenizer(expected, add_special_tokens=False).input_ids
    parts = [{
        "role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    }]
    assert text.engine.chat_prompt(parts)["prompt"] == text.engine.chat_prompt(
        conversations[0])["prompt"]
    # The published SmolLM2-Instruct layout, default system message included.
    assert text.engine.chat_prompt(conversations[0])["prompt"] == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")


# ---- model resolution ----
def test_known_aliases():
    aliases = known_aliases()
    assert {"qwen3-vl", "qwen3-vl-tiny", "smollm2"} <= set(aliases) and aliases == sorted(aliases)
    assert resolve_model("smollm2").gguf_file.endswith(".gguf")


def test_unknown_alias_and_missing_path_list_what_was_tried(tmp_path):
    with pytest.raises(ModelNotFoundError, match="known aliases") as err:
        resolve_model("qwen9-vl")
    assert "Tried: local path" in str(err.value) and "qwen3-vl-tiny" in str(err.value)
    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError):
        resolve_model("")


def test_repo_not_in_cache_offline_gives_the_download_command(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("vlinfer-tests/no-such-model")
    message = str(err.value)
    assert "Hugging Face cache for repo 'vlinfer-tests/no-such-model'" in message
    assert "huggingface-cli download vlinfer-tests/no-such-model" in message


def test_default_vl_alias_falls_back_loudly(caplog, monkeypatch, tmp_path):
    # An empty Hugging Face cache, whatever this machine holds: the fallback is tested everywhere,
    # never skipped.
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        source = resolve_model("qwen3-vl")
    assert source.embedded and source.name == "qwen3-vl"
    assert source.path == resolve_model("qwen3-vl-toy").path and "drawn scenes" in source.about
    assert any("TOY" in r.getMessage() and "knows NOTHING else" in r.getMessage() and
               "huggingface-cli download Qwen/Qwen3-VL-2B-Instruct" in r.getMessage()
               for r in caplog.records if r.levelno >= logging.WARNING)
