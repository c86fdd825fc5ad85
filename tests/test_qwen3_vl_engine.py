"""Qwen3-VL through the whole engine (processor, encoder cache, paged decoder) against transformers, float32."""
import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import assert_block_pool_empty
from vlinfer import LLM, SamplingParams
from vlinfer.engine import SchedulerOutput
from vlinfer.multimodal import Qwen3VLImageProcessor
from vlinfer.tiny_checkpoints import build_tiny_qwen3_vl

NUM_NEW = 12
IMAGE = 151655
PROMPT_1 = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n" \
           "<|im_start|>assistant\n"
PROMPT_2 = "<|im_start|>user\nCompare <|vision_start|><|image_pad|><|vision_end|> with " \
           "<|vision_start|><|image_pad|><|vision_end|> please.<|im_end|>\n<|im_start|>assistant\n"
PROMPT_0 = "<|im_start|>user\nWrite one word about the sea.<|im_end|>\n<|im_start|>assistant\n"


def picture(h, w, seed):
    rng = np.random.RandomState(seed)
    base = rng.randint(0, 255, (1, 1, 3)) + np.linspace(0, 60, w)[None, :, None] + rng.randint(0, 40, (h, w, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


IMG_A, IMG_B, IMG_C = picture(120, 160, 1), picture(200, 90, 2), picture(64, 64, 3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3VLForConditionalGeneration
    path = build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("tiny-qwen3-vl")), seed=0, tie_word_embeddings=False)
    return path, Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def make_llm(path, **kw):
    kw.setdefault("kv_cache_bytes", 32 * 2 ** 20)
    kw.setdefault("max_model_len", 1024)
    return LLM(path, dtype="float32", **kw)


def hf_inputs(llm, prompt_ids, images, max_pixels=None):
    """Token ids expanded by our processor; pixels by transformers' own Qwen3-VL image processor."""
    from transformers import Qwen2VLImageProcessor
    expanded = llm.engine.process_prompt({"prompt_token_ids": prompt_ids,
                                          "multi_modal_data": {"image": images},
                                          "mm_processor_kwargs": {"max_pixels": max_pixels} if max_pixels else {}})[1]
    ids = torch.tensor([expanded])
    kwargs = {"mm_token_type_ids": (ids == IMAGE).int()}
    if images:
        size = {"shortest_edge": 65536, "longest_edge": max_pixels or 16777216}
        proc = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                     image_std=[0.5] * 3, size=size)
        px = proc(images=images, return_tensors="pt")
        kwargs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    return ids, kwargs


def hf_greedy(model, ids, kwargs, num_new=NUM_NEW):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


CASES = [(PROMPT_1, [IMG_A]), (PROMPT_2, [IMG_B, IMG_C]), (PROMPT_0, []), (PROMPT_1, [IMG_C])]


@pytest.fixture(scope="module")
def references(checkpoint):
    path, model = checkpoint
    llm = make_llm(path)
    refs = []
    for text, images in CASES:
        ids, kwargs = hf_inputs(llm, llm.tokenizer(text).input_ids, images)
        refs.append(hf_greedy(model, ids, kwargs))
    return refs


def requests():
    return [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in CASES]


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


def test_prompt_logits_match_transformers(checkpoint):
    path, model = checkpoint
    llm = make_llm(path)
    engine = llm.engine
    for text, images in CASES[:3]:
        seq = engine.make_sequence({"prompt": text, "multi_modal_data": {"image": images}})
        engine.add_sequence(seq)  # holds its images in the encoder cache
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        ids, kwargs = hf_inputs(llm, llm.tokenizer(text).input_ids, images)
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
    assert [len(o.images) for o in outs] == [1, 2, 0, 1]
    assert outs[0].images[0] == {"size": [224, 320], "num_tokens": 70}
    # IMG_C appears in two requests but is encoded once; every image exactly once.
    assert llm.engine.model_runner.num_images_encoded == 3
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
    per_block = probe.engine.model_runner.bytes_per_block
    longest = max(probe.engine.make_sequence(r).num_tokens for r in requests()) + NUM_NEW
    # Room for the longest request and a little more, for four requests: they must preempt and recompute.
    blocks = (longest + 15) // 16 + 1
    llm = make_llm(path, kv_cache_bytes=blocks * per_block, max_model_len=blocks * 16, max_num_batched_tokens=32)
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
    # Same text, same placeholder count, another image of the same size: only blocks before the image hit.
    other = picture(120, 160, 99)
    swapped = llm.generate([{"prompt": PROMPT_1, "multi_modal_data": {"image": [other]}}], GREEDY,
                           use_tqdm=False)[0]
    assert swapped.prompt_token_ids == first.prompt_token_ids
    first_image_token = first.prompt_token_ids.index(IMAGE)
    assert swapped.num_cached_tokens == first_image_token // 16 * 16
    ids, kwargs = hf_inputs(llm, llm.tokenizer(PROMPT_1).input_ids, [other])
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
    out = llm.chat(messages, GREEDY, use_tqdm=False, mm_processor_kwargs={"max_pixels": 128 * 128})[0]
    assert "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>What differs?" \
        in out.prompt
    proc = Qwen3VLImageProcessor()
    assert [i["num_tokens"] for i in out.images] == [proc.num_image_tokens(120, 160, max_pixels=128 * 128),
                                                     proc.num_image_tokens(200, 90, max_pixels=128 * 128)]
    assert all(h * w <= 128 * 128 for h, w in (i["size"] for i in out.images))
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What differs?"}]}],
        tokenize=False, add_generation_prompt=True, chat_template=llm.engine.chat_template)
    ids, kwargs = hf_inputs(llm, llm.tokenizer(text, add_special_tokens=False).input_ids, [IMG_A, IMG_B],
                            max_pixels=128 * 128)
    assert out.outputs[0].token_ids == hf_greedy(model, ids, kwargs)
    assert_block_pool_empty(llm)


@pytest.mark.parametrize("request_, match", [
    ({"prompt": PROMPT_1, "multi_modal_data": {"image": []}}, "1 <|image_pad|> placeholder"),
    ({"prompt": PROMPT_0, "multi_modal_data": {"image": [IMG_A]}}, "0 <|image_pad|> placeholder"),
    ({"prompt": PROMPT_1, "multi_modal_data": {"image": [b"not an image"]}}, "image 0"),
    ({"prompt": PROMPT_1, "multi_modal_data": {"image": ["https://example.com/cat.png"]}}, "URL loading is off"),
    ({"prompt": PROMPT_1, "multi_modal_data": {"video": [IMG_A]}}, "only 'image'"),
    ({"prompt": PROMPT_1, "multi_modal_data": {"image": [IMG_A]}, "mm_processor_kwargs": {"dpi": 3}}, "dpi"),
])
def test_bad_multimodal_requests(checkpoint, request_, match):
    llm = make_llm(checkpoint[0])
    with pytest.raises(ValueError, match=match):
        llm.generate([requests()[2], request_], GREEDY, use_tqdm=False)
    assert llm.generate([requests()[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert_block_pool_empty(llm)


def test_chat_text_with_vision_tokens_is_rejected(checkpoint):
    llm = make_llm(checkpoint[0])
    with pytest.raises(ValueError, match="special vision token"):
        llm.chat([{"role": "user", "content": "look <|image_pad|> here"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="unsupported content part"):
        llm.chat([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], GREEDY, use_tqdm=False)
