"""Offline image+text throughput, vlinfer vs transformers `generate`, side by side in one process on
the same Qwen3-VL weights and the same inputs.

The workload: seeded random images (each side uniform between the min and max size) and a short
question each, in the Qwen3-VL chat layout, greedy, EOS ignored, a fixed number of output tokens.
The checkpoint has the real Qwen3-VL-2B-Instruct shape (its published config values) with random
weights, the real Qwen tokenizer and a preprocessor_config.json; it is built once in bf16 and
cached. vlinfer runs every request at once through the streaming API (add_request + step) so each
request's time to first token is seen; transformers runs left-padded batches. Both timings include
image preprocessing and prompt tokenization.

    python bench/vlm_throughput.py                                      # 32 requests, 64 output
    tokens, 2B, bf16
    python bench/vlm_throughput.py --shape tiny --num-requests 4 --max-tokens 8  # quick end-to-end
    check
    python bench/vlm_throughput.py --device cuda                         # both engines on the GPU
    python bench/vlm_throughput.py --video --num-requests 16             # 16 clips of 4-8 s,
    448x448, 2 fps
"""
import gc
import json
import os
import random
import sys
import time

import numpy as np
import torch

# `vlinfer bench --vlm` loads this file by its path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import vlm_common  # noqa: E402
import vlm_video  # noqa: E402  the --video workload
from common import CPU_PEAK_PROBE, machine, matmul_peak_gflops, progress, table  # noqa: E402
from vlm_common import IMAGE, PAD, PREPROCESSOR, parse_size  # noqa: E402

PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n"
          "<|im_start|>assistant\n")
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


# -------------------------------------------------------------------------------------------------
# workload

def picture(width: int, height: int, seed: int):
    """A seeded random RGB image: a random base colour, a horizontal ramp and per-pixel noise."""
    from PIL import Image
    rng = np.random.RandomState(seed)
    base = rng.randint(0, 255, (1, 1, 3)) + np.linspace(0, 60, width)[None, :, None] + \
        rng.randint(0, 40, (height, width, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def make_workload(args):
    rng = random.Random(args.seed)
    (min_w, min_h), (max_w,
                     max_h) = parse_size(args.min_image_size), parse_size(args.max_image_size)
    requests = []
    for i in range(args.num_requests):
        w, h = rng.randint(min_w, max_w), rng.randint(min_h, max_h)
        requests.append(
            (PROMPT.format(question=rng.choice(QUESTIONS)), picture(w, h, args.seed * 100003 + i)))
    return requests


# -------------------------------------------------------------------------------------------------
# engines

def run_vlinfer(args, path, requests, max_model_len, **engine_options):
    """engine_options: LLM arguments over this script's (bench/hybrid_throughput.py sizes a hybrid
    model's pool its own way)."""
    from vlinfer import LLM, SamplingParams
    from vlinfer.multimodal import Qwen3VLImageProcessor
    proc = Qwen3VLImageProcessor.from_pretrained(path)
    kv_bytes = vlm_common.kv_cache_bytes(
        path, args.dtype, [proc.num_image_tokens(im.height, im.width) for _, im in requests],
        args.max_tokens, max_model_len)
    options = dict(dtype=args.dtype, max_model_len=max_model_len, kv_cache_bytes=kv_bytes,
                   device=args.device,
                   quantization=common.quantization(getattr(args, "quantization", "none")))
    llm = LLM(path, **dict(options, **engine_options))
    engine = llm.engine

    # Warm-up: one small request through the whole path (processor, vision tower, prefill, decode).
    warm = {
        "prompt": PROMPT.format(question="Hi."),
        "multi_modal_data": {"image": [picture(256, 256, 10**6)]}
    }
    llm.generate([warm], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)

    timer = vlm_common.Timer(args.device)
    # Instance attributes shadow the methods for this run only.
    engine.make_sequences = timer.wrap("preprocess", engine.make_sequences)
    engine.model_runner.model.encode_images = timer.wrap("vision",
                                                         engine.model_runner.model.encode_images)

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs, ttft, steps, elapsed = vlm_common.stream(
        engine, [{"prompt": text, "multi_modal_data": {"image": [image]}}
                 for text, image in requests], params)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = dict(tokens=produced, seconds=elapsed, ttft_mean=sum(ttft) / len(ttft),
                 max_num_batched_tokens=engine.resolved.max_num_batched_tokens,
                 ttft_max=max(ttft), preprocess=timer.seconds["preprocess"],
                 vision=timer.seconds["vision"], steps=steps,
                 images_encoded=engine.model_runner.vision.num_images_encoded,
                 prompt_tokens=sum(len(o.prompt_token_ids)
                                   for o in outs), image_tokens=sum(i["num_tokens"] for o in outs
                                                                    for i in o.images),
                 prompt_ids=[o.prompt_token_ids
                             for o in outs], outputs=[o.outputs[0].token_ids for o in outs])
    # The timing wrappers close over bound methods: drop them so no reference cycle keeps the engine
    # alive.
    del engine.make_sequences, engine.model_runner.model.encode_images
    del engine, llm, outs
    gc.collect()
    return stats


def transformers_inputs(path):
    """prepare(batch of (prompt, image)) -> (token id rows, generate's inputs): transformers' side
    of the pipeline: its image processor, placeholders expanded to the grid's token count (as
    Qwen3VLProcessor does), left padding."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor
    tokenizer = AutoTokenizer.from_pretrained(path)
    size = PREPROCESSOR["size"]
    proc = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2,
                                 image_mean=[0.5] * 3, image_std=[0.5] * 3, size=size)

    def prepare(batch):
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
        return rows, dict(input_ids=ids, attention_mask=mask,
                          mm_token_type_ids=(ids == IMAGE).int(), pixel_values=px["pixel_values"],
                          image_grid_thw=grid)
    return prepare


def run_transformers(args, path, requests):
    model = vlm_common.hf_model(path, args.dtype, args.device)
    prepare = transformers_inputs(path)

    def generate(inputs, n):
        return vlm_common.hf_generate(model, inputs, n, args.device)

    # warm-up
    generate(prepare([(PROMPT.format(question="Hi."), picture(256, 256, 10 ** 6))])[1], 4)
    all_rows, outputs, prep = [], [], 0.0
    start = time.perf_counter()
    for batch in vlm_common.batches(requests, args.hf_batch_size, start):
        t = time.perf_counter()
        rows, inputs = prepare(batch)
        prep += time.perf_counter() - t
        outputs.extend(generate(inputs, args.max_tokens))
        all_rows.extend(rows)
    elapsed = time.perf_counter() - start
    produced = sum(len(o) for o in outputs)
    assert produced == args.max_tokens * len(requests), produced
    del model
    gc.collect()
    return dict(tokens=produced, seconds=elapsed, preprocess=prep, prompt_ids=all_rows,
                outputs=outputs)


# -------------------------------------------------------------------------------------------------
# compute floor

def workload_flops(path, image_patches, prompt_lens, max_tokens) -> dict[str, float]:
    """Multiply-add FLOPs (2 per MAC) the workload needs whatever the engine: vision tower,
    language-model prefill and decode, attention included; no padding, logits only where a token is
    sampled."""
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
    # causal: half of 4 n^2 q_dim per layer
    prefill += sum(2 * n * n * q_dim * layers for n in prompt_lens)
    decode_tokens = requests * (max_tokens - 1)
    contexts = sum(n + i for n in prompt_lens for i in range(1, max_tokens))
    decode = decode_tokens * (per_token + lm_head) + 4 * q_dim * layers * contexts
    return {
        "vision linear": vision_linear, "vision attention": vision_attention, "prefill": prefill,
        "decode": decode
    }


# -------------------------------------------------------------------------------------------------
# main

def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--shape", default="2b", choices=["2b", "tiny"],
                   help="2b: Qwen3-VL-2B-Instruct's shape; tiny: tiny_qwen3_vl_config() defaults")
    p.add_argument(
        "--checkpoint", default=None, help=
        "random checkpoint cache folder (default ~/.cache/vlinfer/bench-qwen3-vl-<shape>-random)")
    common.add_dtype_arg(p)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-image-size", default="224x224", help="WxH")
    p.add_argument("--max-image-size", default="896x672", help="WxH")
    p.add_argument("--max-tokens", type=int, default=64)
    common.add_seed_arg(p)
    common.add_transformers_args(p, batch_size=8)
    p.add_argument("--device", default="cpu", help="both engines run here: cpu or cuda")
    p.add_argument("--quantization", default="none", choices=common.QUANTIZATIONS,
                   help="vlinfer's weights quantized on load (transformers keeps the dense ones)")
    vlm_video.add_args(p)
    args = p.parse_args(argv)
    folder = args.checkpoint or f"~/.cache/vlinfer/bench-qwen3-vl-{args.shape}-random"
    path = vlm_common.ensure_checkpoint(folder, args.shape, args.seed)
    if args.video:
        return vlm_video.main(args, path)

    from vlinfer.multimodal import Qwen3VLImageProcessor
    requests = make_workload(args)
    proc = Qwen3VLImageProcessor.from_pretrained(path)
    image_tokens = [proc.num_image_tokens(im.height, im.width) for _, im in requests]
    max_model_len = -(-(max(image_tokens) + 64 + args.max_tokens) // 256) * 256
    print(f"machine: {machine(args.device)}")
    print(
        f"workload: {args.num_requests} requests, one image each ({args.min_image_size} to "
        f"{args.max_image_size}, "
        f"{sum(image_tokens)} image tokens, {min(image_tokens)}-{max(image_tokens)} per image), "
        f"{args.max_tokens} output tokens each (EOS ignored, greedy), Qwen3-VL {args.shape} random "
        "weights "
        f"{args.dtype}, {path}", flush=True)

    rows = []
    v = run_vlinfer(args, path, requests, max_model_len)
    rows.append(("vlinfer", v["tokens"], v["seconds"]))
    progress(
        f"vlinfer done: {v['tokens'] / v['seconds']:.1f} tok/s, {v['seconds']:.1f}s "
        f"({v['prompt_tokens']} prompt "
        f"tokens, {v['steps']} steps); TTFT mean {v['ttft_mean']:.1f}s max {v['ttft_max']:.1f}s; "
        "preprocessing "
        f"{v['preprocess']:.1f}s, vision tower {v['vision']:.1f}s")
    h = None
    if not args.skip_transformers:
        h = run_transformers(args, path, requests)
        rows.append(
            (f"transformers generate (batch {args.hf_batch_size})", h["tokens"], h["seconds"]))
        progress(f"transformers done: {h['tokens'] / h['seconds']:.1f} tok/s, {h['seconds']:.1f}s")

    vlm_common.engine_table(rows)
    if h is not None:
        ratio = (v["tokens"] / v["seconds"]) / (h["tokens"] / h["seconds"])
        print(f"\nvlinfer / transformers throughput ratio: {ratio:.2f}x")
    total = v["seconds"]
    table(["vlinfer breakdown", "seconds", "share of total"],
          [(label, f"{s:.1f}", f"{s / total:.0%}")
           for label, s in [("time to first token, mean",
                             v["ttft_mean"]), ("time to first token, max", v["ttft_max"]),
                            ("preprocessing (image load + processor, make_sequences)",
                             v["preprocess"]), ("vision tower (encode_images)", v["vision"]),
                            ("rest (prefill + decode + scheduling)",
                             total - v["preprocess"] - v["vision"]), ("total", total)]])
    flops = workload_flops(path, [4 * n for n in image_tokens],
                           [len(ids) for ids in v["prompt_ids"]], args.max_tokens)
    peak = matmul_peak_gflops(getattr(torch, args.dtype), args.device)
    floor = sum(flops.values()) / peak / 1e9
    table(["work (same for every engine)", "TFLOP", "seconds at the matmul peak"],
          [(name, f"{f / 1e12:.1f}", f"{f / peak / 1e9:.1f}") for name, f in flops.items()]
          + [("total", f"{sum(flops.values()) / 1e12:.1f}", f"{floor:.1f}")])
    peak_shape = "torch.matmul 8192^3" if args.device.startswith("cuda") else CPU_PEAK_PROBE
    print(
        f"\ncompute floor: {floor:.1f}s with every FLOP at this machine's {args.dtype} matmul "
        "peak, measured now "
        f"({peak:.0f} GFLOP/s, {peak_shape}); vlinfer runs at {floor / total:.0%} of it", end="")
    if h is not None:
        print(
            f", transformers at {floor / h['seconds']:.0%}; 2x transformers needs "
            f"{h['seconds'] / 2:.1f}s, "
            f"{2 * floor / h['seconds']:.0%} of the peak over the whole run")
    else:
        print()
    if h is not None:
        same_ids = sum(a == b for a, b in zip(v["prompt_ids"], h["prompt_ids"]))
        same_first = sum(a[:1] == b[:1] for a, b in zip(v["outputs"], h["outputs"]))
        same_all = sum(a == b for a, b in zip(v["outputs"], h["outputs"]))
        print(
            "\ntransformers preprocessing (image processor + tokenize + pad): "
            f"{h['preprocess']:.1f}s of "
            f"{h['seconds']:.1f}s")
        print(
            f"inputs identical for {same_ids}/{len(requests)} requests; greedy outputs agree on "
            "the first token "
            f"for {same_first}/{len(requests)}, on all tokens for {same_all}/{len(requests)} "
            "(random weights: "
            f"near-tied bf16 logits, so later divergence is expected)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
