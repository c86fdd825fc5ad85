"""Embedding throughput, vlinfer vs transformers, side by side in one process on the same Qwen3-VL
weights and inputs.

The workload: seeded random images (each side uniform between the min and max size) and short texts,
each one item in the Qwen3-VL-Embedding format (the default instruction as the system turn, the item
as the user turn, the generation prompt; inputs/retrieval.py), on a random-weight checkpoint of the
real Qwen3-VL-2B shape (the embedder is that model without its LM head; docs/retrieval.md). vlinfer
runs Pipeline.embed (every item at once); transformers runs the Qwen embedder's own path: its
processor, right-padded batches through Qwen3VLModel, the last token's hidden state, L2-normalized.
Both timings include preprocessing. The work is prefill only and compute bound, so the share of the
machine's matmul peak, measured in the same run, is the figure that counts.

    python bench/embed.py                                    # 256 images + 256 texts, 2B shape,
    bf16
    python bench/embed.py --num-images 32 --num-texts 32     # a shorter run
    python bench/embed.py --shape tiny --num-images 4 --num-texts 4 --skip-transformers   # a quick
    check
"""
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import vlm_common  # noqa: E402
from common import CPU_PEAK_PROBE, machine, matmul_peak_gflops, progress, table  # noqa: E402
from vlm_common import parse_size  # noqa: E402
from vlm_throughput import picture, workload_flops  # noqa: E402

TEXTS = [
    "a red house by the sea", "two dogs playing in the snow",
    "a city street at night with neon signs", "a plate of pasta with basil",
    "an old map of the coastline", "children flying a kite in a park", "a mountain lake at sunrise",
    "a chart of quarterly sales"
]


def make_items(args) -> list[dict]:
    rng = random.Random(args.seed)
    (min_w, min_h), (max_w,
                     max_h) = parse_size(args.min_image_size), parse_size(args.max_image_size)
    items = [{
        "image": picture(rng.randint(min_w, max_w), rng.randint(min_h, max_h),
                         args.seed * 100003 + i)
    } for i in range(args.num_images)]
    items += [{"text": f"{rng.choice(TEXTS)} ({i})"} for i in range(args.num_texts)]
    return items


def run_vlinfer(args, path, items, prefix_caching: bool) -> dict:
    from vlinfer import Pipeline
    pipe = Pipeline(path, dtype=args.dtype, runner="pooling", max_model_len=4096,
                    device=args.device, enable_prefix_caching=prefix_caching)
    pipe.embed(texts=["warm up"], images=[picture(224, 224, 10 ** 6)])
    vectors, seconds = [], {}
    for kind in ("image", "text"):  # images, then texts: each one call, all its items at once
        start = time.perf_counter()
        vectors += pipe.embed(items=[it for it in items if kind in it])
        seconds[kind] = time.perf_counter() - start
    prompts = [pipe.engine.chat_prompt(m) for m in _conversations(items)]
    stats = dict(seconds=seconds, vectors=vectors, texts=[p["prompt"] for p in prompts])
    pipe.llm.close()
    return stats


def _conversations(items):
    from vlinfer.inputs.retrieval import embedding_messages
    return [embedding_messages(item) for item in items]


def run_transformers(args, path, items, texts: list[str]) -> dict:
    """The Qwen embedder's path: Qwen3VLProcessor (right padding), Qwen3VLModel, the last real
    token, normalized; the same rendered prompts as vlinfer's, media sized by the same limits."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from vlinfer.inputs.retrieval import IMAGE_OPTIONS
    model = vlm_common.hf_model(path, args.dtype, args.device).model
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="right")
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(path),
                                 tokenizer=tokenizer, video_processor=Qwen3VLVideoProcessor())
    size = {
        "shortest_edge": IMAGE_OPTIONS["min_pixels"], "longest_edge": IMAGE_OPTIONS["max_pixels"]
    }
    vectors, seconds = [None] * len(items), {}
    for kind in ("image", "text"):
        start = time.perf_counter()
        _hf_batches(args, model, processor, size, items, texts, vectors, kind)
        seconds[kind] = time.perf_counter() - start
    return dict(seconds=seconds, vectors=vectors)


def _hf_batches(args, model, processor, size, items, texts, vectors, kind: str) -> None:
    order = [i for i in range(len(items)) if kind in items[i]]
    for lo in range(0, len(order), args.hf_batch_size):
        batch = order[lo:lo + args.hf_batch_size]
        images = [items[i]["image"] for i in batch if "image" in items[i]]
        inputs = processor(text=[texts[i] for i in batch], images=images or None, padding=True,
                           return_tensors="pt", images_kwargs={"size": size})
        inputs = {k: v.to(args.device) for k, v in inputs.items()}
        with torch.inference_mode():
            hidden = model(**inputs).last_hidden_state
        last = inputs["attention_mask"].sum(1) - 1  # right padding: the last real token
        pooled = torch.nn.functional.normalize(hidden[torch.arange(len(batch)), last].float(),
                                               dim=-1)
        for i, row in zip(batch, pooled.cpu()):
            vectors[i] = row


def embed_flops(path, image_tokens: list[int], prompt_lens: list[int]) -> float:
    """The workload's FLOPs whatever the engine: vlm_throughput's count for one prefill per item,
    less the LM head row it counts per request (an embedder has none)."""
    import json
    flops = workload_flops(path, [4 * n for n in image_tokens], prompt_lens, max_tokens=1)
    text = json.load(open(os.path.join(path, "config.json")))["text_config"]
    return sum(flops.values()) - len(prompt_lens) * 2 * text["hidden_size"] * text["vocab_size"]


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--shape", default="2b", choices=["2b", "tiny"])
    p.add_argument(
        "--checkpoint", default=None, help=
        "random checkpoint cache folder (default ~/.cache/vlinfer/bench-qwen3-vl-<shape>-random)")
    common.add_dtype_arg(p)
    p.add_argument("--num-images", type=int, default=256)
    p.add_argument("--num-texts", type=int, default=256)
    p.add_argument("--min-image-size", default="224x224", help="WxH")
    p.add_argument("--max-image-size", default="448x448", help="WxH")
    common.add_seed_arg(p)
    common.add_transformers_args(p, batch_size=8)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    folder = args.checkpoint or f"~/.cache/vlinfer/bench-qwen3-vl-{args.shape}-random"
    path = vlm_common.ensure_checkpoint(folder, args.shape, args.seed)
    items = make_items(args)
    print(f"machine: {machine(args.device)}")
    print(
        f"workload: {args.num_images} images ({args.min_image_size} to {args.max_image_size}) + "
        f"{args.num_texts} "
        f"short texts, one embedding each, Qwen3-VL {args.shape} random weights {args.dtype}, "
        f"{path}",
        flush=True)
    peak = matmul_peak_gflops(getattr(torch, args.dtype), args.device)
    v = run_vlinfer(args, path, items, prefix_caching=True)
    progress(f"vlinfer done: {len(items) / sum(v['seconds'].values()):.2f} items/s")
    nv = run_vlinfer(args, path, items, prefix_caching=False)
    progress(
        f"vlinfer without prefix caching done: {len(items) / sum(nv['seconds'].values()):.2f} "
        "items/s"
    )
    from vlinfer.multimodal import Qwen3VLImageProcessor
    from vlinfer.inputs.retrieval import IMAGE_OPTIONS
    proc = Qwen3VLImageProcessor.from_pretrained(path)
    image_tokens = [proc.num_image_tokens(it["image"].height, it["image"].width, **IMAGE_OPTIONS)
                    for it in items if "image" in it]
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(path)
    prompt_lens, k = [], 0
    for item, text in zip(items, v["texts"]):
        n = len(tokenizer(text).input_ids)
        if "image" in item:
            n += image_tokens[k] - 1
            k += 1
        prompt_lens.append(n)
    flops = embed_flops(path, image_tokens, prompt_lens)
    rows = [("vlinfer (prefix caching on)", v["seconds"]),
            ("vlinfer (prefix caching off)", nv["seconds"])]
    h = None
    if not args.skip_transformers:
        h = run_transformers(args, path, items, v["texts"])
        rows.append(
            (f"transformers, Qwen embedder path (batch {args.hf_batch_size})", h["seconds"]))
        progress(f"transformers done: {len(items) / sum(h['seconds'].values()):.2f} items/s")
    n_images = args.num_images
    image_flops = embed_flops(path, image_tokens, prompt_lens[:n_images]) if n_images else 0.0
    text_flops = flops - image_flops
    table([
        "engine", "images/s", "texts/s", "total time (s)", "share of matmul peak: images", "texts",
        "all"
    ], [(name, f"{n_images / s['image']:.2f}", f"{args.num_texts / s['text']:.2f}",
         f"{sum(s.values()):.1f}", f"{image_flops / s['image'] / peak / 1e9:.0%}",
         f"{text_flops / s['text'] / peak / 1e9:.0%}",
         f"{flops / sum(s.values()) / peak / 1e9:.0%}") for name, s in rows])
    print(
        f"\nwork: {flops / 1e12:.2f} TFLOP ({sum(prompt_lens)} prompt tokens, {sum(image_tokens)} "
        "image tokens); "
        f"{args.dtype} matmul peak measured now: {peak:.0f} GFLOP/s ({CPU_PEAK_PROBE})")
    if h is not None:
        print(
            f"vlinfer / transformers: images {h['seconds']['image'] / v['seconds']['image']:.2f}x, "
            "texts "
            f"{h['seconds']['text'] / v['seconds']['text']:.2f}x, all "
            f"{sum(h['seconds'].values()) / sum(v['seconds'].values()):.2f}x")
        worst = max(
            (torch.tensor(a) - b).abs().max().item() for a, b in zip(v["vectors"], h["vectors"]))
        cosine = min(
            torch.dot(torch.tensor(a), b).item() for a, b in zip(v["vectors"], h["vectors"]))
        print(
            f"same vectors: largest difference {worst:.2e}, lowest cosine {cosine:.5f} "
            f"({args.dtype})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
