"""Offline image+text throughput, vlinfer vs transformers `generate`, side by side in one process on the same
Qwen3-VL weights and the same inputs.

The workload: seeded random images (each side uniform between the min and max size) and a short question each, in
the Qwen3-VL chat layout, greedy, EOS ignored, a fixed number of output tokens. The checkpoint has the real
Qwen3-VL-2B-Instruct shape (its published config values) with random weights, the real Qwen tokenizer and a
preprocessor_config.json; it is built once in bf16 and cached. vlinfer runs every request at once through the
streaming API (add_request + step) so each request's time to first token is seen; transformers runs left-padded
batches. Both timings include image preprocessing and prompt tokenization.

    python bench/vlm_throughput.py                                      # 32 requests, 64 output tokens, 2B, bf16
    python bench/vlm_throughput.py --shape tiny --num-requests 4 --max-tokens 8  # quick end-to-end check
    python bench/vlm_throughput.py --device cuda                         # both engines on the GPU
    python bench/vlm_throughput.py --video --num-requests 16             # 16 clips of 4-8 s, 448x448, 2 fps
"""
import argparse
import gc
import json
import os
import random
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `vlinfer bench --vlm` loads this file by its path
from machine import load, machine, matmul_peak_gflops, synchronize  # noqa: E402

IMAGE, VIDEO, VISION_START, VISION_END = 151655, 151656, 151652, 151653
PAD = 151643  # <|endoftext|>, Qwen's pad token
PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "Describe this image.",
    "What is in the picture?",
    "What colors do you see?",
    "Is there any text in this image?",
    "Describe the scene in one sentence.",
    "What stands out most here?",
    "How many objects are there?",
    "What is the mood of this image?",
]
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
                "resample": 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}


# ------------------------------------------------------------------------------------------------- checkpoint

def qwen3_vl_2b_config():
    """Qwen3-VL-2B-Instruct's published config.json values."""
    from transformers import Qwen3VLConfig
    return Qwen3VLConfig(
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
                           num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
                           hidden_act="gelu_pytorch_tanh", initializer_range=0.02),
        text_config=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                         max_position_embeddings=262144, hidden_act="silu", attention_bias=False,
                         initializer_range=0.02, tie_word_embeddings=True, bos_token_id=151643,
                         eos_token_id=151645,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        tie_word_embeddings=True, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END)


def ensure_checkpoint(folder: str, shape: str, seed: int) -> str:
    """Build the random-weight checkpoint once (bf16 safetensors, config, tokenizer, preprocessor config) and reuse
    it afterwards. Built directly in bf16 (one copy in RAM) into a temporary folder that is renamed when complete,
    so an interrupted build is never mistaken for a finished one."""
    folder = os.path.abspath(os.path.expanduser(folder))
    if os.path.exists(os.path.join(folder, ".complete")):
        return folder
    from transformers import Qwen3VLForConditionalGeneration
    from vlinfer.tiny_checkpoints import qwen_tokenizer_files, tiny_qwen3_vl_config
    print(f"building the random {shape} Qwen3-VL checkpoint in {folder} (once) ...", flush=True)
    start = time.perf_counter()
    config = qwen3_vl_2b_config() if shape == "2b" else tiny_qwen3_vl_config()
    torch.manual_seed(seed)
    # transformers' default init (std 0.02, norms 1): modest magnitudes, fine for a throughput benchmark.
    model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    model.save_pretrained(partial, safe_serialization=True)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    tokenizer_dir = qwen_tokenizer_files()
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), partial)
    with open(os.path.join(partial, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR, f, indent=2)
    open(os.path.join(partial, ".complete"), "w").close()
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(partial, folder)
    print(f"built {num_params / 1e9:.2f}B parameters in {time.perf_counter() - start:.0f}s", flush=True)
    return folder


# ------------------------------------------------------------------------------------------------- workload

def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height)."""
    w, h = text.lower().split("x")
    return int(w), int(h)


def picture(width: int, height: int, seed: int):
    """A seeded random RGB image: a random base colour, a horizontal ramp and per-pixel noise."""
    from PIL import Image
    rng = np.random.RandomState(seed)
    base = rng.randint(0, 255, (1, 1, 3)) + np.linspace(0, 60, width)[None, :, None] + \
        rng.randint(0, 40, (height, width, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def make_workload(args):
    rng = random.Random(args.seed)
    (min_w, min_h), (max_w, max_h) = parse_size(args.min_image_size), parse_size(args.max_image_size)
    requests = []
    for i in range(args.num_requests):
        w, h = rng.randint(min_w, max_w), rng.randint(min_h, max_h)
        requests.append((PROMPT.format(question=rng.choice(QUESTIONS)), picture(w, h, args.seed * 100003 + i)))
    return requests


# ------------------------------------------------------------------------------------------------- engines

def run_vlinfer(args, path, requests, max_model_len):
    from vlinfer import LLM, SamplingParams
    from vlinfer.multimodal import Qwen3VLImageProcessor
    # KV pool: every request at full length at once, so nothing waits for blocks or preempts.
    proc = Qwen3VLImageProcessor.from_pretrained(path)
    tokens_per_block = 16
    cfg = json.load(open(os.path.join(path, "config.json")))["text_config"]
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * element
    blocks = sum(-(-(proc.num_image_tokens(im.height, im.width) + 64 + args.max_tokens) // tokens_per_block)
                 for _, im in requests)
    blocks = max(blocks, -(-max_model_len // tokens_per_block)) + 8  # the engine wants one full-length sequence
    kv_bytes = blocks * tokens_per_block * per_token
    llm = LLM(path, dtype=args.dtype, max_model_len=max_model_len, kv_cache_bytes=kv_bytes, device=args.device)
    engine = llm.engine

    # Warm-up: one small request through the whole path (processor, vision tower, prefill, decode).
    warm = {"prompt": PROMPT.format(question="Hi."), "multi_modal_data": {"image": [picture(256, 256, 10 ** 6)]}}
    llm.generate([warm], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    timers = {"preprocess": 0.0, "vision": 0.0}
    make_sequences, encode_images = engine.make_sequences, engine.model_runner.model.encode_images

    def timed_make_sequences(*a, **kw):
        t = time.perf_counter()
        try:
            return make_sequences(*a, **kw)
        finally:
            timers["preprocess"] += time.perf_counter() - t

    def timed_encode_images(*a, **kw):
        t = time.perf_counter()
        try:
            return encode_images(*a, **kw)
        finally:
            synchronize(args.device)  # an accelerator runs the tower asynchronously: wait for it to count its time
            timers["vision"] += time.perf_counter() - t

    engine.make_sequences = timed_make_sequences  # instance attributes shadow the methods for this run only
    engine.model_runner.model.encode_images = timed_encode_images

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    first, final = {}, {}
    start = time.perf_counter()
    ids = [engine.add_request({"prompt": text, "multi_modal_data": {"image": [image]}}, params)
           for text, image in requests]
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
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == args.max_tokens * len(requests), (produced, args.max_tokens * len(requests))
    ttft = [first[i] for i in ids]
    stats = dict(tokens=produced, seconds=elapsed, ttft_mean=sum(ttft) / len(ttft), ttft_max=max(ttft),
                 preprocess=timers["preprocess"], vision=timers["vision"], steps=steps,
                 images_encoded=engine.model_runner.num_images_encoded,
                 prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
                 image_tokens=sum(i["num_tokens"] for o in outs for i in o.images),
                 prompt_ids=[o.prompt_token_ids for o in outs], outputs=[o.outputs[0].token_ids for o in outs])
    # The timing wrappers close over bound methods: drop them so no reference cycle keeps the engine alive.
    del engine.make_sequences, engine.model_runner.model.encode_images
    del engine, llm, outs, final, make_sequences, encode_images
    gc.collect()
    return stats


def run_transformers(args, path, requests):
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLForConditionalGeneration
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    size = PREPROCESSOR["size"]
    proc = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, size=size)

    def prepare(batch):
        """transformers' side of the pipeline: its image processor, placeholders expanded to the grid's token
        count (as Qwen3VLProcessor does), left padding."""
        px = proc(images=[image for _, image in batch], return_tensors="pt")
        grid = px["image_grid_thw"]
        rows = []
        for (text, _), thw in zip(batch, grid.tolist()):
            n = thw[0] * thw[1] * thw[2] // 4
            ids = []
            for t in tokenizer(text).input_ids:
                ids.extend([IMAGE] * n if t == IMAGE else [t])
            rows.append(ids)
        width = max(map(len, rows))
        ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return rows, dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE).int(),
                          pixel_values=px["pixel_values"], image_grid_thw=grid)

    def generate(inputs, n):
        inputs = {k: v.to(args.device) for k, v in inputs.items()}
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=PAD)
        return out[:, inputs["input_ids"].shape[1]:].tolist()

    generate(prepare([(PROMPT.format(question="Hi."), picture(256, 256, 10 ** 6))])[1], 4)  # warm-up
    all_rows, outputs, prep = [], [], 0.0
    start = time.perf_counter()
    for i in range(0, len(requests), args.hf_batch_size):
        t = time.perf_counter()
        rows, inputs = prepare(requests[i:i + args.hf_batch_size])
        prep += time.perf_counter() - t
        outputs.extend(generate(inputs, args.max_tokens))
        all_rows.extend(rows)
        print(f"  transformers batch {i // args.hf_batch_size + 1}/{-(-len(requests) // args.hf_batch_size)} "
              f"done at {time.perf_counter() - start:.0f}s; {load()}", flush=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o) for o in outputs)
    assert produced == args.max_tokens * len(requests), produced
    del model
    gc.collect()
    return dict(tokens=produced, seconds=elapsed, preprocess=prep, prompt_ids=all_rows, outputs=outputs)


# ------------------------------------------------------------------------------------------------- compute floor

def workload_flops(path, image_patches, prompt_lens, max_tokens) -> dict[str, float]:
    """Multiply-add FLOPs (2 per MAC) the workload needs whatever the engine: vision tower, language-model prefill
    and decode, attention included; no padding, logits only where a token is sampled."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    v, t = cfg["vision_config"], cfg["text_config"]
    hv, iv = v["hidden_size"], v["intermediate_size"]
    merged = hv * v["spatial_merge_size"] ** 2
    patch_in = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    mergers = 1 + len(v["deepstack_visual_indexes"])
    patches = sum(image_patches)
    vision_linear = 2 * patches * (patch_in * hv + v["depth"] * (4 * hv * hv + 2 * hv * iv))
    merged_tokens = patches // v["spatial_merge_size"] ** 2
    vision_linear += 2 * merged_tokens * mergers * merged * (merged + v["out_hidden_size"])
    vision_attention = 4 * hv * v["depth"] * sum(n * n for n in image_patches)
    h, hd, layers = t["hidden_size"], t["head_dim"], t["num_hidden_layers"]
    q_dim, kv_dim = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    per_token = 2 * layers * (h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * t["intermediate_size"])
    lm_head = 2 * h * t["vocab_size"]
    requests = len(prompt_lens)
    prefill = sum(prompt_lens) * per_token + requests * lm_head
    prefill += sum(2 * n * n * q_dim * layers for n in prompt_lens)  # causal: half of 4 n^2 q_dim per layer
    decode_tokens = requests * (max_tokens - 1)
    contexts = sum(n + i for n in prompt_lens for i in range(1, max_tokens))
    decode = decode_tokens * (per_token + lm_head) + 4 * q_dim * layers * contexts
    return {"vision linear": vision_linear, "vision attention": vision_attention, "prefill": prefill,
            "decode": decode}


# ------------------------------------------------------------------------------------------------- main

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="2b", choices=["2b", "tiny"],
                   help="2b: Qwen3-VL-2B-Instruct's shape; tiny: tiny_qwen3_vl_config() defaults")
    p.add_argument("--checkpoint", default=None,
                   help="random checkpoint cache folder (default ~/.cache/vlinfer/bench-qwen3-vl-<shape>-random)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-image-size", default="224x224", help="WxH")
    p.add_argument("--max-image-size", default="896x672", help="WxH")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--device", default="cpu", help="both engines run here: cpu or cuda")
    import vlm_video  # the --video workload (bench/vlm_video.py)
    vlm_video.add_args(p)
    args = p.parse_args(argv)
    folder = args.checkpoint or f"~/.cache/vlinfer/bench-qwen3-vl-{args.shape}-random"
    path = ensure_checkpoint(folder, args.shape, args.seed)
    if args.video:
        return vlm_video.main(args, path)

    from vlinfer.multimodal import Qwen3VLImageProcessor
    requests = make_workload(args)
    proc = Qwen3VLImageProcessor.from_pretrained(path)
    image_tokens = [proc.num_image_tokens(im.height, im.width) for _, im in requests]
    max_model_len = -(-(max(image_tokens) + 64 + args.max_tokens) // 256) * 256
    accelerator = f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""
    print(f"machine: {machine()}{accelerator}")
    print(f"workload: {args.num_requests} requests, one image each ({args.min_image_size} to {args.max_image_size}, "
          f"{sum(image_tokens)} image tokens, {min(image_tokens)}-{max(image_tokens)} per image), "
          f"{args.max_tokens} output tokens each (EOS ignored, greedy), Qwen3-VL {args.shape} random weights "
          f"{args.dtype}, {path}", flush=True)

    rows = []
    v = run_vlinfer(args, path, requests, max_model_len)
    rows.append(("vlinfer", v["tokens"], v["seconds"]))
    print(f"vlinfer done: {v['tokens'] / v['seconds']:.1f} tok/s, {v['seconds']:.1f}s ({v['prompt_tokens']} prompt "
          f"tokens, {v['steps']} steps); TTFT mean {v['ttft_mean']:.1f}s max {v['ttft_max']:.1f}s; preprocessing "
          f"{v['preprocess']:.1f}s, vision tower {v['vision']:.1f}s; {load()}", flush=True)
    h = None
    if not args.skip_transformers:
        h = run_transformers(args, path, requests)
        rows.append((f"transformers generate (batch {args.hf_batch_size})", h["tokens"], h["seconds"]))
        print(f"transformers done: {h['tokens'] / h['seconds']:.1f} tok/s, {h['seconds']:.1f}s; {load()}", flush=True)

    print(f"\n| engine | output tokens | time (s) | output tok/s |\n|---|---|---|---|")
    for name, tokens, seconds in rows:
        print(f"| {name} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} |")
    if h is not None:
        ratio = (v["tokens"] / v["seconds"]) / (h["tokens"] / h["seconds"])
        print(f"\nvlinfer / transformers throughput ratio: {ratio:.2f}x")
    total = v["seconds"]
    print(f"\n| vlinfer breakdown | seconds | share of total |\n|---|---|---|")
    print(f"| time to first token, mean | {v['ttft_mean']:.1f} | {v['ttft_mean'] / total:.0%} |")
    print(f"| time to first token, max | {v['ttft_max']:.1f} | {v['ttft_max'] / total:.0%} |")
    print(f"| preprocessing (image load + processor, make_sequences) | {v['preprocess']:.1f} | "
          f"{v['preprocess'] / total:.0%} |")
    print(f"| vision tower (encode_images) | {v['vision']:.1f} | {v['vision'] / total:.0%} |")
    print(f"| rest (prefill + decode + scheduling) | {total - v['preprocess'] - v['vision']:.1f} | "
          f"{(total - v['preprocess'] - v['vision']) / total:.0%} |")
    print(f"| total | {total:.1f} | 100% |")
    flops = workload_flops(path, [4 * n for n in image_tokens], [len(ids) for ids in v["prompt_ids"]],
                           args.max_tokens)
    peak = matmul_peak_gflops(getattr(torch, args.dtype), args.device)
    floor = sum(flops.values()) / peak / 1e9
    print(f"\n| work (same for every engine) | TFLOP | seconds at the matmul peak |\n|---|---|---|")
    for name, f in flops.items():
        print(f"| {name} | {f / 1e12:.1f} | {f / peak / 1e9:.1f} |")
    print(f"| total | {sum(flops.values()) / 1e12:.1f} | {floor:.1f} |")
    peak_shape = "torch.matmul 8192^3" if args.device.startswith("cuda") else "oneDNN 2048x2048x8192"
    print(f"\ncompute floor: {floor:.1f}s with every FLOP at this machine's {args.dtype} matmul peak, measured now "
          f"({peak:.0f} GFLOP/s, {peak_shape}); vlinfer runs at {floor / total:.0%} of it", end="")
    if h is not None:
        print(f", transformers at {floor / h['seconds']:.0%}; 2x transformers needs {h['seconds'] / 2:.1f}s, "
              f"{2 * floor / h['seconds']:.0%} of the peak over the whole run")
    else:
        print()
    if h is not None:
        same_ids = sum(a == b for a, b in zip(v["prompt_ids"], h["prompt_ids"]))
        same_first = sum(a[:1] == b[:1] for a, b in zip(v["outputs"], h["outputs"]))
        same_all = sum(a == b for a, b in zip(v["outputs"], h["outputs"]))
        print(f"\ntransformers preprocessing (image processor + tokenize + pad): {h['preprocess']:.1f}s of "
              f"{h['seconds']:.1f}s")
        print(f"inputs identical for {same_ids}/{len(requests)} requests; greedy outputs agree on the first token "
              f"for {same_first}/{len(requests)}, on all tokens for {same_all}/{len(requests)} (random weights: "
              f"near-tied bf16 logits, so later divergence is expected)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
