"""Builders and constants of tests/models/test_qwen3_vl_engine.py that other test modules use too
(CASES, PROMPT_0, PROMPT_1, hf_greedy, hf_inputs, requests): imported from here by every one of
them, that module included."""
import torch
from text_checkpoints import hf_qwen3_vl_processor
from images import picture

NUM_NEW = 32
PROMPT_1 = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image." \
           "<|im_end|>\n<|im_start|>assistant\n"
PROMPT_2 = "<|im_start|>user\nCompare <|vision_start|><|image_pad|><|vision_end|> with " \
           "<|vision_start|><|image_pad|><|vision_end|> please.<|im_end|>\n<|im_start|>assistant\n"
PROMPT_0 = "<|im_start|>user\nWrite one word about the sea.<|im_end|>\n<|im_start|>assistant\n"
IMG_A, IMG_B, IMG_C = picture(120, 160, 1), picture(200, 90, 2), picture(64, 64, 3)
IMG_BIG, IMG_TALL, IMG_WIDE = picture(480, 640, 4), picture(1200, 30, 5), picture(25, 1000, 6)


def hf_inputs(llm, text, images, max_pixels=None):
    """transformers' inputs for a prompt, all made by its own Qwen3VLProcessor: placeholders
    expanded (not fed ours) and pixels preprocessed on the engine's device as ours are:
    torchvision's uint8 resize rounds differently on CUDA than on the CPU (one grey level at some
    pixels, measured on an H200), and that, not the model, would separate the logits."""
    size = {"size": {"shortest_edge": 65536, "longest_edge": max_pixels}} if max_pixels else {}
    out = hf_qwen3_vl_processor(llm.engine.source.folder)(text=[text], images=images or None,
                                                          return_tensors="pt",
                                                          device=llm.engine.device, **size)
    kwargs = {"mm_token_type_ids": out["mm_token_type_ids"].cpu()}
    if images:
        kwargs.update(pixel_values=out["pixel_values"].cpu(),
                      image_grid_thw=out["image_grid_thw"].cpu())
    return out["input_ids"].cpu(), kwargs


def hf_greedy(model, ids, kwargs, num_new=NUM_NEW):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                             **kwargs)
    return out[0, ids.shape[1]:].tolist()


# One image; two images with text before, between and after; text only; and large, tall and wide
# images.
CASES = [(PROMPT_1, [IMG_A]), (PROMPT_2, [IMG_B, IMG_C]), (PROMPT_0, []), (PROMPT_1, [IMG_C]),
         (PROMPT_1, [IMG_BIG]), (PROMPT_2, [IMG_TALL, IMG_WIDE])]


def requests():
    return [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
            for text, images in CASES]
