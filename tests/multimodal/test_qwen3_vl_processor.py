"""Qwen3-VL prompts as the engine runs them (placeholders expanded, one grid per image) against
transformers' own Qwen3VLProcessor, built from the embedded checkpoint's preprocessor config and the
real Qwen3 tokenizer: the same input_ids, image_grid_thw, mm_token_type_ids and pixels for one image
and several of varied sizes, with and without pixel limits, and through the chat template. Elsewhere
transformers is fed our expansion; here it makes its own."""
import pytest
import torch
from images import picture

from text_checkpoints import hf_qwen3_vl_processor
from vlinfer import LLM

IMAGE = 151655
PAD = "<|vision_start|><|image_pad|><|vision_end|>"
# as tests/multimodal/test_image_processor.py: the same resize and normalisation, float32
TOL = 1e-5


@pytest.fixture(scope="module")
def llm():
    # 8192 positions: a 1280x720 image alone is 3600 tokens at the default pixel budget.
    return LLM("qwen3-vl-tiny", dtype="float32", device="cpu", max_model_len=8192,
               kv_cache_bytes=16 << 20)


@pytest.fixture(scope="module")
def hf(llm):
    """transformers' processor for the embedded checkpoint, with the chat template the engine uses.
    """
    return hf_qwen3_vl_processor(llm.engine.source.folder, llm.engine.input_processor.chat_template)


def ours(llm, prompt: str, images: list,
         **mm_kwargs) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The engine's expansion of a prompt: token ids, each image's grid and the pixels, in prompt
    order."""
    request = {"prompt": prompt, "multi_modal_data": {"image": images}}
    if mm_kwargs:
        request["mm_processor_kwargs"] = mm_kwargs
    _, token_ids, extra = llm.engine.input_processor.process_prompt(request)
    items = extra.get("mm_items", [])
    grids = torch.stack([item.data["grid_thw"]
                         for item in items]) if items else torch.zeros(0, 3, dtype=torch.long)
    pixels = torch.cat([item.data["pixel_values"] for item in items]) if items else torch.zeros(0)
    return token_ids, grids, pixels


def theirs(hf, prompt: str, images: list, min_pixels=None, max_pixels=None):
    kwargs = {}
    if min_pixels or max_pixels:
        kwargs["size"] = {
            "shortest_edge": min_pixels or 65536, "longest_edge": max_pixels or 16777216
        }
    return hf(text=[prompt], images=images or None, return_tensors="pt", **kwargs)


def assert_same(llm, hf, prompt, images, **mm_kwargs):
    ids, grids, pixels = ours(llm, prompt, images, **mm_kwargs)
    ref = theirs(hf, prompt, images, **mm_kwargs)
    assert ids == ref["input_ids"][0].tolist()
    assert ref["mm_token_type_ids"][0].tolist() == [int(t == IMAGE) for t in ids]
    if images:
        assert grids.tolist() == ref["image_grid_thw"].tolist()
        assert pixels.shape == ref["pixel_values"].shape
        assert (pixels.cpu() - ref["pixel_values"]).abs().max().item() <= TOL
    return ids, grids


def user_turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


SIZES = [(120, 160), (64, 64), (5, 5), (33, 47), (480, 640), (720, 1280), (1200, 30), (25, 1000),
         (1023, 511)]


@pytest.mark.parametrize("hw", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_one_image(llm, hf, hw):
    ids, grids = assert_same(llm, hf, user_turn(f"{PAD}Describe this image."),
                             [picture(*hw, seed=hw[0] + hw[1])])
    t, h, w = grids[0].tolist()
    assert ids.count(IMAGE) == t * h * w // 4  # one token per 2x2 merged patch


def test_several_images_of_varied_sizes_around_text(llm, hf):
    images = [picture(200, 90, 1), picture(64, 64, 2), picture(480, 640, 3), picture(31, 500, 4)]
    prompt = user_turn(f"First {PAD} then{PAD}{PAD} and finally\n{PAD} - how do they differ?")
    ids, grids = assert_same(llm, hf, prompt, images)
    # four different grids, in order
    assert len(grids) == 4 and len({tuple(g) for g in grids.tolist()}) == 4


@pytest.mark.parametrize("limits, sizes", [
    (dict(max_pixels=128 * 128), [(997, 1000), (480, 640)]),  # both downscaled
    (dict(min_pixels=512 * 512), [(997, 1000), (90, 150)]),  # the small one upscaled
    # one down, one as it is
    (dict(min_pixels=32 * 32, max_pixels=300 * 300), [(997, 1000), (90, 150)]),
], ids=["max", "min", "both"])
def test_pixel_limits(llm, hf, limits, sizes):
    images = [picture(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    assert_same(llm, hf, user_turn(f"{PAD}{PAD}Compare."), images, **limits)


def test_max_pixels_wins_where_transformers_upscales_past_it(llm, hf):
    """The one difference, on purpose: an image below the default min_pixels with a smaller
    max_pixels. transformers upscales it to min_pixels, past max_pixels; the engine keeps max_pixels
    a real upper bound."""
    image = picture(90, 150, 6)
    _, grids, _ = ours(llm, user_turn(f"{PAD}Hi."), [image], max_pixels=128 * 128)
    ref = theirs(hf, user_turn(f"{PAD}Hi."), [image], max_pixels=128 * 128)["image_grid_thw"]
    assert grids[0, 1] * grids[0, 2] * 16 * 16 <= 128 * 128 < ref[0, 1] * ref[0, 2] * 16 * 16


def test_text_only_prompt(llm, hf):
    assert_same(llm, hf, user_turn("Write one word about the sea."), [])


def test_chat_messages(llm, hf):
    """A conversation through our chat path and through the processor's apply_chat_template: the
    same ids."""
    images = [picture(120, 160, 7), picture(300, 57, 8)]
    messages = [{"role": "system", "content": "Be brief."}, {
        "role": "user", "content": [{"type": "image", "image": images[0]},
                                    {"type": "text", "text": "Hi."}]
    }, {"role": "assistant", "content": "Hello."}, {
        "role": "user", "content": [{"type": "image", "image": images[1]},
                                    {"type": "text", "text": "And this one?"}]
    }]
    prompt = llm.engine.chat_prompt(messages)
    _, token_ids, extra = llm.engine.input_processor.process_prompt(prompt)
    ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                 add_generation_prompt=True)
    assert token_ids == ref["input_ids"][0].tolist()
    assert torch.stack([i.data["grid_thw"]
                        for i in extra["mm_items"]]).tolist() == ref["image_grid_thw"].tolist()
