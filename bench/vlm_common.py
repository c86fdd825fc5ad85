"""The Qwen3-VL parts bench/vlm_throughput.py (images) and its --video workload, bench/vlm_video.py,
share: the token ids, the random-weight checkpoint built once, the KV pool sized so that no request
waits, vlinfer's streaming run, the timers around engine stages, transformers' model and its
batches, and the side-by-side table. Here so that neither script imports the other's internals
(vlm_throughput imports vlm_video for --video, nothing imports back)."""
import functools
import json
import os
import time

import torch

from common import load, random_checkpoint, synchronize, table

IMAGE, VIDEO, VISION_START, VISION_END = 151655, 151656, 151652, 151653
PAD = 151643  # <|endoftext|>, Qwen's pad token
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
    "resample": 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}
}


def qwen3_vl_2b_config():
    """Qwen3-VL-2B-Instruct's published config.json values."""
    from transformers import Qwen3VLConfig
    return Qwen3VLConfig(
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                           in_channels=3, patch_size=16, temporal_patch_size=2,
                           spatial_merge_size=2, out_hidden_size=2048, num_position_embeddings=2304,
                           deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh",
                           initializer_range=0.02),
        text_config=dict(
            hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
            max_position_embeddings=262144, hidden_act="silu", attention_bias=False,
            initializer_range=0.02, tie_word_embeddings=True, bos_token_id=151643,
            eos_token_id=151645, rope_parameters={
                "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                "mrope_interleaved": True
            }), tie_word_embeddings=True, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)


def ensure_checkpoint(folder: str, shape: str, seed: int) -> str:
    """The random-weight checkpoint in bf16 with its preprocessor config, built once. transformers'
    default init (std 0.02, norms 1): modest magnitudes, fine for a throughput benchmark."""
    def config():
        from vlinfer.toy.tiny_checkpoints import tiny_qwen3_vl_config
        return qwen3_vl_2b_config() if shape == "2b" else tiny_qwen3_vl_config()

    return random_checkpoint(folder, f"{shape} Qwen3-VL", "Qwen3VLForConditionalGeneration", config,
                             torch.bfloat16, seed, files={"preprocessor_config.json": PREPROCESSOR})


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height)."""
    w, h = text.lower().split("x")
    return int(w), int(h)


def kv_cache_bytes(path: str, dtype: str, prompt_tokens: list[int], max_tokens: int,
                   max_model_len: int) -> int:
    """A KV pool holding every request at full length at once (prompt + 64 text tokens + output), so
    nothing waits for blocks or preempts; and at least one max_model_len sequence, which the engine
    wants."""
    tokens_per_block = 16
    cfg = json.load(open(os.path.join(path, "config.json")))["text_config"]
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = (2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
                 * element)
    blocks = sum(-(-(n + 64 + max_tokens) // tokens_per_block) for n in prompt_tokens)
    blocks = max(blocks, -(-max_model_len // tokens_per_block)) + 8
    return blocks * tokens_per_block * per_token


def stream(engine, prompts: list[dict], params):
    """vlinfer's side: every request added at once, then engine steps until all have finished (the
    streaming API, so each request's first output is seen). (outputs in request order, each one's
    seconds to its first output, steps, seconds); every requested token must come back (EOS
    ignored)."""
    first, final = {}, {}
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        now = time.perf_counter() - start
        for out in outs:
            first.setdefault(out.request_id, now)
            if out.finished:
                final[out.request_id] = out
    elapsed = time.perf_counter() - start
    outs = [final[i] for i in ids]
    produced, wanted = sum(len(o.outputs[0].token_ids)
                           for o in outs), params.max_tokens * len(prompts)
    if produced != wanted:
        raise RuntimeError(f"vlinfer produced {produced} tokens, expected {wanted}")
    return outs, [first[i] for i in ids], steps, elapsed


def hf_model(path: str, dtype: str, device: str):
    """transformers' model of the checkpoint's architecture (Qwen3-VL, Qwen3.5) on the same
    weights, on the engines' device."""
    import transformers
    with open(os.path.join(path, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def hf_generate(model, inputs: dict, n: int, device: str) -> list[list[int]]:
    """transformers `generate` on one left-padded batch: exactly n new tokens a row, greedy."""
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=PAD)
    return out[:, inputs["input_ids"].shape[1]:].tolist()


def batches(requests: list, size: int, start: float):
    """transformers' batches of `size`, each followed by a progress line (one batch runs for
    minutes)."""
    count = -(-len(requests) // size)
    for i in range(0, len(requests), size):
        yield requests[i:i + size]
        print(
            f"  transformers batch {i // size + 1}/{count} done at "
            f"{time.perf_counter() - start:.0f}s; {load()}",
            flush=True)


class Timer:
    """Wraps callables so their time adds up under one name (accelerator work waited for)."""

    def __init__(self, device: str):
        self.device, self.seconds = device, {}

    def wrap(self, name: str, fn):
        self.seconds.setdefault(name, 0.0)

        # keeps the signature: transformers' generate reads get_video_features' parameters
        @functools.wraps(fn)
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                synchronize(self.device)
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        return timed


def engine_table(rows) -> None:
    """The side-by-side table of both workloads: (engine, output tokens, seconds) per row."""
    table(["engine", "output tokens", "time (s)", "output tok/s"],
          [(name, tokens, f"{seconds:.1f}", f"{tokens / seconds:.1f}")
           for name, tokens, seconds in rows])
