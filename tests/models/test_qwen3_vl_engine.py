"""Qwen3-VL through the whole engine (processor, encoder cache, paged decoder) against transformers,
float32."""
import base64
import io

import pytest
import torch
from PIL import Image

from engine_checks import assert_block_pool_empty

from images import picture
from vlinfer import LLM, SamplingParams
from vlinfer.engine import SchedulerOutput
from vlinfer.multimodal import Qwen3VLImageProcessor
from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
from qwen3_vl_engine_cases import (CASES, IMG_A, IMG_B, NUM_NEW, PROMPT_0, PROMPT_1, hf_greedy,
                                   hf_inputs, requests)

IMAGE = 151655


SHAPES = {
    # GQA 2:1, rotary sections [6, 5, 5], DeepStack after vision blocks 0 and 1, untied head.
    "heads4-ds01": dict(num_heads=4, num_kv_heads=2, head_dim=32, mrope_section=(6, 5, 5),
                        vision_depth=2, deepstack_visual_indexes=[0, 1], tie_word_embeddings=False),
    # GQA 4:1, sections [4, 2, 2], three text layers, DeepStack after vision blocks 1 and 2. (Untied
    # too: with O(1) random tied embeddings the model just repeats its last input token, which would
    # test nothing; tied loading is covered in test_qwen3_vl_model.py.)
    "heads8-ds12": dict(text_layers=3, num_heads=8, num_kv_heads=2, head_dim=16,
                        mrope_section=(4, 2, 2), vision_depth=3, vision_heads=2,
                        deepstack_visual_indexes=[1, 2], tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory):
    from transformers import Qwen3VLForConditionalGeneration
    path = build_tiny_qwen3_vl(str(tmp_path_factory.mktemp(request.param)), seed=0,
                               **SHAPES[request.param])
    return path, Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def make_llm(path, **kw):
    kw.setdefault("kv_cache_bytes", 32 * 2 ** 20)
    kw.setdefault("max_model_len", 1024)
    return LLM(path, dtype="float32", **kw)


@pytest.fixture(scope="module")
def references(checkpoint):
    path, model = checkpoint
    llm = make_llm(path)
    refs = []
    for text, images in CASES:
        ids, kwargs = hf_inputs(llm, text, images)
        refs.append(hf_greedy(model, ids, kwargs))
    return refs


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


def test_prompt_logits_match_transformers(checkpoint):
    path, model = checkpoint
    llm = make_llm(path)
    engine = llm.engine
    for text, images in CASES:
        seq = engine.make_sequence({"prompt": text, "multi_modal_data": {"image": images}})
        engine.add_sequence(seq)  # holds its images in the encoder cache
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        ids, kwargs = hf_inputs(llm, text, images)
        assert ids[0].tolist() == seq.token_ids
        with torch.no_grad():
            ref = model(input_ids=ids, **kwargs).logits[0]
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
        engine.abort_request(seq.request_id)
    assert len(engine.model_runner.encoder_cache) == 0
    assert_block_pool_empty(llm)


def test_mixed_batch_matches_transformers(checkpoint, references):
    llm = make_llm(checkpoint[0])
    outs = llm.generate(requests(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references
    assert [len(o.images) for o in outs] == [1, 2, 0, 1, 1, 2]
    assert outs[0].images[0] == {"size": [224, 320], "num_tokens": 70}
    # IMG_C appears in two requests but is encoded once; every image exactly once.
    assert llm.engine.model_runner.vision.num_images_encoded == 6
    assert len(llm.engine.model_runner.encoder_cache) == 0
    assert_block_pool_empty(llm)


@pytest.mark.parametrize("budget", [16, 64, None], ids=["chunk16", "chunk64", "unlimited"])
def test_chunked_prefill_through_images(checkpoint, references, budget):
    llm = make_llm(checkpoint[0], max_num_batched_tokens=budget)
    outs = llm.generate(requests(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references
    assert_block_pool_empty(llm)


def test_preemption_keeps_outputs_and_frees_everything(checkpoint, references):
    path = checkpoint[0]
    probe = make_llm(path)
    per_block = probe.engine.model_runner.cache_pool.bytes_per_block
    longest = max(probe.engine.make_sequence(r).num_tokens for r in requests()) + NUM_NEW
    # Room for the longest request and a little more, for four requests: they must preempt and
    # recompute.
    blocks = (longest + 15) // 16 + 1
    llm = make_llm(path, kv_cache_bytes=blocks * per_block, max_model_len=blocks * 16,
                   max_num_batched_tokens=32)
    outs = llm.generate(requests(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(llm.engine.model_runner.encoder_cache) == 0
    assert_block_pool_empty(llm)


def test_prefix_cache_reuses_same_image_only(checkpoint, references):
    llm = make_llm(checkpoint[0])
    first = llm.generate([requests()[0]], GREEDY, use_tqdm=False)[0]
    again = llm.generate([requests()[0]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == references[0]
    # Same text, same placeholder count, another image of the same size: only blocks before the
    # image hit.
    other = picture(120, 160, 99)
    swapped = llm.generate([{"prompt": PROMPT_1, "multi_modal_data": {"image": [other]}}], GREEDY,
                           use_tqdm=False)[0]
    assert swapped.prompt_token_ids == first.prompt_token_ids
    first_image_token = first.prompt_token_ids.index(IMAGE)
    assert swapped.num_cached_tokens == first_image_token // 16 * 16
    ids, kwargs = hf_inputs(llm, PROMPT_1, [other])
    assert swapped.outputs[0].token_ids == hf_greedy(checkpoint[1], ids, kwargs)
    assert_block_pool_empty(llm)


def test_chat_with_image_parts_and_per_request_pixels(checkpoint):
    path, model = checkpoint
    llm = make_llm(path)
    buf = io.BytesIO()
    IMG_B.save(buf, format="PNG")
    data_uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image", "image": IMG_A},
        {"type": "image_url", "image_url": {"url": data_uri}},
        {"type": "text", "text": "What differs?"}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False,
                   mm_processor_kwargs={"max_pixels": 128 * 128})[0]
    assert ("<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>"
            "What differs?") in out.prompt
    proc = Qwen3VLImageProcessor()
    assert [i["num_tokens"] for i in out.images] == [
        proc.num_image_tokens(120, 160, max_pixels=128 * 128),
        proc.num_image_tokens(200, 90, max_pixels=128 * 128)
    ]
    assert all(h * w <= 128 * 128 for h, w in (i["size"] for i in out.images))
    text = llm.tokenizer.apply_chat_template([{
        "role": "user", "content": [{"type": "image"}, {"type": "image"},
                                    {"type": "text", "text": "What differs?"}]
    }], tokenize=False, add_generation_prompt=True,
                                             chat_template=llm.engine.input_processor.chat_template)
    ids, kwargs = hf_inputs(llm, text, [IMG_A, IMG_B], max_pixels=128 * 128)
    assert out.outputs[0].token_ids == hf_greedy(model, ids, kwargs)
    assert_block_pool_empty(llm)


def jpeg_bytes(image, truncate=False):
    buf = io.BytesIO()
    image.save(buf, format="JPEG")
    data = buf.getvalue()
    return data[:len(data) // 2] if truncate else data


def png_bomb():
    """A PNG whose header declares 20000 x 20000 pixels but carries no data: a bomb's header,
    rejected before decoding without spending memory to build a real one."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(
        b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


BAD_IMAGES = {
    "truncated JPEG": (jpeg_bytes(IMG_A, truncate=True), "image 0"),
    "non-image bytes": (b"definitely not an image", "image 0"),
    "zero-size image": (Image.new("RGB", (0, 0)), "image 0"),
    "decompression bomb": (png_bomb(), "pixels"),
    "aspect ratio over 200": (picture(2, 500, 7), "aspect ratio"),
    "unreachable URL": ("http://127.0.0.1:9/cat.png", "image 0"),
    "URL with fetching off": ("https://example.com/cat.png", "URL loading is off"),
}


@pytest.mark.parametrize("bad", list(BAD_IMAGES))
def test_bad_image_is_a_per_request_error(checkpoint, references, bad):
    from vlinfer import RequestError
    image, match = BAD_IMAGES[bad]
    llm = make_llm(checkpoint[0], allow_image_urls=not bad.startswith("URL with"))
    reqs = requests()[:2] + [{"prompt": PROMPT_1, "multi_modal_data": {"image": [image]}}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(RequestError, match=match) as info:
        llm.generate(reqs, params, use_tqdm=False)
    outs = info.value.outputs
    # the others completed
    assert [o.outputs[0].token_ids for o in outs[:2]] == [r[:4] for r in references[:2]]
    assert outs[2].error and outs[2].outputs[0].finish_reason == "error" and "request 2" in str(
        info.value)
    assert_block_pool_empty(llm)


@pytest.mark.parametrize("request_, match", [
    ({"prompt": PROMPT_1, "multi_modal_data": {"image": []}}, "1 <|image_pad|> placeholder"),
    ({"prompt": PROMPT_0, "multi_modal_data": {"image": [IMG_A]}}, "0 <|image_pad|> placeholder"),
    ({"prompt": PROMPT_1, "multi_modal_data": {"audio": [IMG_A]}
      }, "'image' and 'video' are supported"),
    ({"prompt": PROMPT_1, "multi_modal_data": {"image": [IMG_A], "video": [IMG_A]}
      }, "0 <|video_pad|> placeholder"),
    ({
        "prompt": PROMPT_1, "multi_modal_data": {"image": [IMG_A]},
        "mm_processor_kwargs": {"dpi": 3}
    }, "dpi"),
])
def test_bad_multimodal_requests(checkpoint, references, request_, match):
    llm = make_llm(checkpoint[0])
    with pytest.raises(ValueError, match=match):
        llm.generate([requests()[2], request_], GREEDY, use_tqdm=False)
    # and the next call is served, with transformers' answer
    out = llm.generate([requests()[0]], SamplingParams(temperature=0, max_tokens=2,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == references[0][:2]
    assert_block_pool_empty(llm)


def test_different_images_are_never_confused(checkpoint):
    path, model = checkpoint
    llm = make_llm(path)
    one_pixel = IMG_A.copy()
    one_pixel.putpixel((5, 7), tuple((c + 128) % 256 for c in IMG_A.getpixel((5, 7))))
    other = picture(120, 160, 42)
    outs = llm.generate([{"prompt": PROMPT_1, "multi_modal_data": {"image": [im]}}
                         for im in (IMG_A, one_pixel, other)], GREEDY, use_tqdm=False)
    assert llm.engine.model_runner.vision.num_images_encoded == 3
    for out, image in zip(outs, (IMG_A, one_pixel, other)):
        ids, kwargs = hf_inputs(llm, PROMPT_1, [image])
        assert out.outputs[0].token_ids == hf_greedy(model, ids, kwargs)
    # same text, another image: other words
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids
    # Run again: each image finds its own cached prefix, never the other's.
    image_start = outs[0].prompt_token_ids.index(IMAGE)
    again = llm.generate([{"prompt": PROMPT_1, "multi_modal_data": {"image": [one_pixel]}}], GREEDY,
                         use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert again[0].num_cached_tokens > image_start
    assert_block_pool_empty(llm)


def test_chat_text_with_vision_tokens_is_rejected(checkpoint):
    llm = make_llm(checkpoint[0])
    with pytest.raises(ValueError, match="special vision token"):
        llm.chat([{"role": "user", "content": "look <|image_pad|> here"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="unsupported content part"):
        llm.chat([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], GREEDY,
                 use_tqdm=False)


def test_chat_media_parts_are_split_in_order_and_a_missing_source_is_named():
    from vlinfer.multimodal.chat import split_chat_media
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "a.png"}}, {"type": "text", "text": "and"},
        {"type": "video", "video": "b.mp4"}, {"type": "input_image", "image": "c.png"},
        {"type": "video_url", "video_url": {"url": "d.mp4"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
    out, images, videos = split_chat_media(messages)
    assert images == ["a.png", "c.png"] and videos == ["b.mp4", "d.mp4"]
    assert [p["type"] for p in out[0]["content"]] == ["image", "text", "video", "image", "video"]
    assert out[1]["content"] == "ok"  # text-only parts become a plain string
    with pytest.raises(ValueError,
                       match=r"message 0 part 1: an image part needs 'image' or 'image_url'"):
        split_chat_media(
            [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url"}]}])
    with pytest.raises(ValueError,
                       match=r"message 0 part 0: a video part needs 'video' or 'video_url'"):
        split_chat_media([{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}])
