"""Builders and constants of tests/captioning/test_retrieval.py that other test modules use too
(IMG_A, IMG_B, IMG_C, RERANKER, VIDEO_CONFIG, hf_embedding, hf_score): imported from here by
every one of them, that module included."""
import functools

import torch
from images import picture
from vlinfer.toy.tiny_checkpoints import qwen_tokenizer_files

RERANKER = {
    "architectures": ["Qwen3VLForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True
}
# The Qwen code's sizes (qwen3_vl_embedding.py MIN_PIXELS / MAX_PIXELS, FPS), which Pipeline passes.
IMAGE_SIZE = {"shortest_edge": 4 * 32 * 32, "longest_edge": 1800 * 32 * 32}
VIDEO_CONFIG = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"shortest_edge": 4096,
             "longest_edge": 25165824}, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True, "resample": 3
}
IMG_A, IMG_B, IMG_C = picture(120, 160, 1), picture(96, 64, 2), picture(64, 64, 3)


@functools.cache
def hf_processor(folder: str, chat_template: str):
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
                            tokenizer=AutoTokenizer.from_pretrained(qwen_tokenizer_files()),
                            video_processor=Qwen3VLVideoProcessor.from_pretrained(folder),
                            chat_template=chat_template)


def qwen_parts(item: dict) -> list[dict]:
    """Qwen's format_model_input / format_mm_content: videos, then images, then texts."""
    videos = item.get("video", [])
    images = item.get("image", [])
    texts = item.get("text", [])
    videos, images, texts = ([x] if not isinstance(x, list) else x for x in (videos, images, texts))
    return [{"type": "video", "video": v} for v in videos] + \
        [{"type": "image", "image": i} for i in images] + \
        [{"type": "text", "text": t} for t in texts]


def hf_last_hidden(llm, model, conversation) -> torch.Tensor:
    """transformers' Qwen3VLModel over the conversation as the Qwen code feeds it: rendered with the
    generation prompt, processed by its own processor; the final hidden state at the last token."""
    from transformers.video_utils import VideoMetadata
    processor = hf_processor(llm.engine.source.folder, llm.engine.input_processor.chat_template)
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    parts = [p for turn in conversation for p in turn["content"]]
    images = [p["image"] for p in parts if p["type"] == "image"]
    videos = [p["video"] for p in parts if p["type"] == "video"]
    kwargs = {}
    if videos:
        kwargs.update(
            videos=[v for v, _ in videos], do_sample_frames=True, fps=1.0, video_metadata=[
                VideoMetadata(total_num_frames=len(v), fps=m["fps"]) for v, m in videos
            ])
    out = processor(text=[text], images=images or None, return_tensors="pt",
                    images_kwargs={"size": IMAGE_SIZE}, **kwargs)
    inputs = {
        k: out[k]
        for k in ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos",
                  "video_grid_thw", "mm_token_type_ids") if k in out
    }
    with torch.no_grad():
        return model.model(**inputs).last_hidden_state[0, -1]


def hf_embedding(llm, model, item, instruction="Represent the user's input.") -> torch.Tensor:
    conversation = [{"role": "system", "content": [{"type": "text", "text": instruction}]},
                    {"role": "user", "content": qwen_parts(item)}]
    return torch.nn.functional.normalize(hf_last_hidden(llm, model, conversation), dim=-1)


def hf_score(llm, model, query, document, instruction) -> float:
    """Qwen3VLReranker.compute_scores: sigmoid of (lm_head[yes] - lm_head[no]) . h at the last
    token."""
    system = (
        'Judge whether the Document meets the requirements based on the Query and the Instruct '
        'provided. '
        'Note that the answer can only be "yes" or "no".')
    content = [{"type": "text",
                "text": "<Instruct>: " + instruction}, {"type": "text", "text": "<Query>:"},
               *qwen_parts(query), {"type": "text", "text": "\n<Document>:"}, *qwen_parts(document)]
    conversation = [{"role": "system", "content": [{"type": "text", "text": system}]},
                    {"role": "user", "content": content}]
    h = hf_last_hidden(llm, model, conversation)
    vocab = llm.tokenizer.get_vocab()
    w = model.lm_head.weight
    return torch.sigmoid((w[vocab["yes"]] - w[vocab["no"]]) @ h).item()
