"""Builders and constants of tests/multimodal/test_video.py that other test modules use too (ASK,
CLIP_ODD, HUB_VIDEO_CONFIG, META_ODD, V, hf_inputs, request): imported from here by every one of
them, that module included."""
import functools

from videos import drawn_clip

ASK = "<|im_start|>user\n{}What happens?<|im_end|>\n<|im_start|>assistant\n"
V = "<|vision_start|><|video_pad|><|vision_end|>"
# 10 frames at 4 fps: fps=2 samples 5 -> padded to 6, 3 groups of 4 x 5 merged windows: 20 tokens a
# group, more than the chunked test's 16-token step budget, so one group's tokens span two steps.
CLIP_ODD = drawn_clip(10, 112, 160, seed=2)
META_EVEN, META_ODD = {"fps": 8.0}, {"fps": 4.0}
# The released checkpoints' video_preprocessor_config.json (hub copies of Qwen3-VL-4B/8B): its size
# replaces the class defaults, so both engines must read it; it also keeps the tiny clips at their
# own size (few tokens).
HUB_VIDEO_CONFIG = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"shortest_edge": 4096,
             "longest_edge": 25165824}, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True, "resample": 3
}


@functools.cache
def hf_processor(folder):
    """transformers' Qwen3VLProcessor with the folder's image and video preprocessor configs (built
    once per folder: loading the tokenizer costs seconds)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as HF
    from vlinfer.toy.tiny_checkpoints import qwen_tokenizer_files
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
                            tokenizer=AutoTokenizer.from_pretrained(qwen_tokenizer_files()),
                            video_processor=HF.from_pretrained(folder))


def request(text, images, videos, **mm_kwargs):
    data = {}
    if images:
        data["image"] = images
    if videos:
        data["video"] = videos
    out = {"prompt": text, "multi_modal_data": data} if data else text
    if mm_kwargs:
        out["mm_processor_kwargs"] = mm_kwargs
    return out


def hf_inputs(folder, text, images, videos, fps=2):
    """transformers' own Qwen3VLProcessor (its video processor samples and sizes, it writes the
    timestamps)."""
    from transformers.video_utils import VideoMetadata
    kwargs = {}
    if videos:
        kwargs.update(
            videos=[v for v, _ in videos], do_sample_frames=True, fps=fps, video_metadata=[
                VideoMetadata(total_num_frames=len(v), fps=m["fps"]) for v, m in videos
            ])
    out = hf_processor(folder)(text=[text], images=images or None, return_tensors="pt", **kwargs)
    model_kwargs = {"mm_token_type_ids": out["mm_token_type_ids"]}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if key in out:
            model_kwargs[key] = out[key]
    return out["input_ids"], model_kwargs
