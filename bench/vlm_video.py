"""`bench/vlm_throughput.py --video`: offline video+text throughput, vlinfer vs transformers
`generate`, side by side in one process on the same random Qwen3-VL weights and the same clips.

The workload: seeded clips drawn here (a moving square over a noisy background, --video-size pixels,
a random
length between --min-seconds and --max-seconds at --source-fps), written as H.264 MP4 files before
timing starts;
one question each in the Qwen3-VL chat layout, greedy, EOS ignored, a fixed number of output tokens.
Both sides
read the files and sample at --fps (2 by default, transformers' Qwen3-VL default) with the released
checkpoints'
video_preprocessor_config.json (the clip-wide pixel budget 4096..25165824), so they see the same
frames:
  - vlinfer: the paths go in as multi_modal_data={"video": [path]}; its PyAV loader seeks to the
    sampled frames;
  - transformers: what its processor does with a video path (BaseVideoProcessor.fetch_videos), here
    with the PyAV
    backend since torchcodec is not installed: video_utils.load_video(path, backend="pyav",
    sample_indices_fn=the
    video processor's sample_frames), then Qwen3VLProcessor (timestamps from the sampled source
    indices), left-padded
    batches of --hf-batch-size.
Timed on each side: decode + frame sampling, the rest of preprocessing, the vision tower, and the
language model (the
rest of the run).
"""
import gc
import json
import os
import random
import tempfile
import time

import numpy as np

import vlm_common
from common import machine, progress, table
from vlm_common import parse_size

VIDEO_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{question}<|im_end|>\n"
    "<|im_start|>assistant\n")
QUESTIONS = [
    "Describe this video.", "What happens in the clip?", "What moves in this video?",
    "Summarize the clip in one sentence.", "What changes over time?", "What colors do you see?"
]
# The released Qwen3-VL checkpoints' video_preprocessor_config.json (hub copies of Qwen3-VL-4B/8B).
VIDEO_PREPROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"shortest_edge": 4096,
             "longest_edge": 25165824}, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True, "resample": 3
}


def add_args(p) -> None:
    g = p.add_argument_group("--video workload")
    g.add_argument("--video", action="store_true",
                   help="clips instead of images (see bench/vlm_video.py)")
    g.add_argument("--video-size", default="448x448", help="WxH of every clip (default 448x448)")
    g.add_argument("--min-seconds", type=float, default=4.0)
    g.add_argument("--max-seconds", type=float, default=8.0)
    g.add_argument("--source-fps", type=int, default=24, help="the files' frame rate (default 24)")
    g.add_argument("--fps", type=float, default=2.0, help="frames sampled per second (default 2)")


def ensure_video_config(path: str) -> None:
    target = os.path.join(path, "video_preprocessor_config.json")
    if not os.path.exists(target):
        with open(target + ".tmp", "w") as f:
            json.dump(VIDEO_PREPROCESSOR, f, indent=2)
        os.replace(target + ".tmp", target)


def drawn_clip(num_frames: int, height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base_frame = np.kron(
        rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3)).astype(np.uint8),
        np.ones((16, 16, 1), np.uint8))[:height, :width]
    clip = np.repeat(base_frame[None], num_frames, axis=0)
    side = max(8, min(height, width) // 6)
    for t in range(num_frames):
        y, x = (t * 3) % (height - side), (t * 5) % (width - side)
        clip[t, y:y + side, x:x + side] = 255
    return clip


def write_clip(frames: np.ndarray, fps: int, path: str) -> None:
    import av
    with av.open(path, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "18"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def make_workload(args, folder: str) -> list[tuple[str, str, float]]:
    """(prompt, clip path, seconds) per request; the files are written once per run, before any
    timing."""
    rng = random.Random(args.seed)
    width, height = parse_size(args.video_size)
    requests = []
    for i in range(args.num_requests):
        seconds = rng.uniform(args.min_seconds, args.max_seconds)
        frames = drawn_clip(max(2, round(seconds * args.source_fps)), height, width,
                            args.seed * 100003 + i)
        path = os.path.join(folder, f"clip_{i:03d}.mp4")
        write_clip(frames, args.source_fps, path)
        requests.append((VIDEO_PROMPT.format(question=rng.choice(QUESTIONS)), path,
                         len(frames) / args.source_fps))
    return requests


def clip_tokens(path: str, args, seconds: float) -> int:
    """Prompt tokens a clip takes (an upper bound: 8 text tokens per group for its timestamp and
    vision_start/end)."""
    from vlinfer.multimodal.video_processor import Qwen3VLVideoProcessor, VideoOptions
    proc = Qwen3VLVideoProcessor.from_pretrained(path)
    width, height = parse_size(args.video_size)
    total = round(seconds * args.source_fps)
    n = len(proc.sample_indices(total, args.source_fps, VideoOptions(fps=args.fps)))
    h, w = proc.resized_size(n, height, width, VideoOptions())
    return -(-n // 2) * (h // 32 * w // 32 + 8)


def run_vlinfer(args, path, requests, max_model_len, tokens):
    from vlinfer import LLM, SamplingParams
    from vlinfer.multimodal import video_prompt
    llm = LLM(
        path, dtype=args.dtype, max_model_len=max_model_len, device=args.device,
        kv_cache_bytes=vlm_common.kv_cache_bytes(path, args.dtype, tokens, args.max_tokens,
                                                 max_model_len))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # warm-up
    llm.generate([{"prompt": requests[0][0], "multi_modal_data": {"video": [requests[0][1]]}}],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    timer = vlm_common.Timer(args.device)
    load_video, model = video_prompt.load_video, engine.model_runner.model
    video_prompt.load_video = timer.wrap("decode", load_video)  # this run only: put back below
    engine.make_sequences = timer.wrap("preprocess", engine.make_sequences)
    model.encode_images = timer.wrap("vision", model.encode_images)
    mm_kwargs = {"fps": args.fps}
    try:
        outs, _, steps, elapsed = vlm_common.stream(engine, [{
            "prompt": text, "multi_modal_data": {"video": [clip]}, "mm_processor_kwargs": mm_kwargs
        } for text, clip, _ in requests], params)
    finally:
        video_prompt.load_video = load_video
        del engine.make_sequences, model.encode_images
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = dict(tokens=produced, seconds=elapsed, steps=steps, **timer.seconds,
                 frames=sum(v["num_frames"] for o in outs for v in o.videos),
                 video_tokens=sum(v["num_video_tokens"] for o in outs
                                  for v in o.videos), prompt_ids=[o.prompt_token_ids for o in outs],
                 outputs=[o.outputs[0].token_ids for o in outs])
    stats["preprocess"] -= stats["decode"]  # preprocessing beside decode + sampling
    del engine, llm, outs, model
    gc.collect()
    return stats


def run_transformers(args, path, requests):
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import load_video
    model = vlm_common.hf_model(path, args.dtype, args.device)
    video_processor = Qwen3VLVideoProcessor.from_pretrained(path)
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(path),
                                 tokenizer=AutoTokenizer.from_pretrained(path, padding_side="left"),
                                 video_processor=video_processor)
    timer = vlm_common.Timer(args.device)
    model.model.get_video_features = timer.wrap("vision", model.model.get_video_features)

    def decode(clip):
        """What fetch_videos does for a path: decode only the frames the processor's sampler picks.
        """
        return load_video(clip, backend="pyav", sample_indices_fn=lambda metadata, **_:
                          video_processor.sample_frames(metadata, fps=args.fps))

    def prepare(batch):
        t = time.perf_counter()
        loaded = [decode(clip) for _, clip, _ in batch]
        timer.seconds["decode"] = timer.seconds.get("decode", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        inputs = processor(text=[text
                                 for text, _, _ in batch], videos=[frames for frames, _ in loaded],
                           video_metadata=[metadata for _, metadata in loaded],
                           do_sample_frames=False, padding=True, return_tensors="pt")
        timer.seconds["preprocess"] = timer.seconds.get("preprocess", 0.0) + time.perf_counter() - t
        rows = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])
        ]
        return rows, inputs

    def generate(inputs, n):
        return vlm_common.hf_generate(model, inputs, n, args.device)

    generate(prepare(requests[:1])[1], 4)  # warm-up
    # the warm-up's time is not the run's
    timer.seconds = {"decode": 0.0, "preprocess": 0.0, "vision": 0.0}
    all_rows, outputs = [], []
    start = time.perf_counter()
    for batch in vlm_common.batches(requests, args.hf_batch_size, start):
        rows, inputs = prepare(batch)
        outputs.extend(generate(inputs, args.max_tokens))
        all_rows.extend(rows)
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return dict(tokens=sum(len(o) for o in outputs), seconds=elapsed, prompt_ids=all_rows,
                outputs=outputs, **timer.seconds)


def breakdown(name: str, s: dict) -> None:
    total = s["seconds"]
    lm = total - s["decode"] - s["preprocess"] - s["vision"]
    table([name, "seconds", "share of the run"],
          [(label, f"{seconds:.1f}", f"{seconds / total:.0%}")
           for label, seconds in [("decode + frame sampling",
                                   s["decode"]), ("other preprocessing",
                                                  s["preprocess"]), ("vision tower", s["vision"]),
                                  ("language model (prefill + decode) and the rest",
                                   lm), ("total", total)]])


def main(args, path: str) -> int:
    ensure_video_config(path)
    print(f"machine: {machine(args.device)}")
    with tempfile.TemporaryDirectory(prefix="vlinfer-bench-clips-") as folder:
        t = time.perf_counter()
        requests = make_workload(args, folder)
        tokens = [clip_tokens(path, args, seconds) for _, _, seconds in requests]
        max_model_len = -(-(max(tokens) + 64 + args.max_tokens) // 256) * 256
        print(
            f"workload: {len(requests)} clips of {min(s for *_, s in requests):.1f}-"
            f"{max(s for *_, s in requests):.1f} s, {args.video_size} at {args.source_fps} fps "
            "(H.264 MP4, written "
            f"in {time.perf_counter() - t:.0f}s, not timed), sampled at {args.fps} fps; "
            f"{args.max_tokens} output "
            f"tokens each (EOS ignored, greedy), Qwen3-VL {args.shape} random weights "
            f"{args.dtype}, {path}",
            flush=True)
        v = run_vlinfer(args, path, requests, max_model_len, tokens)
        progress(
            f"vlinfer done: {v['tokens'] / v['seconds']:.1f} tok/s, {v['seconds']:.1f}s "
            f"({v['frames']} frames, "
            f"{v['video_tokens']} video tokens, {v['steps']} steps)")
        h = None
        if not args.skip_transformers:
            h = run_transformers(args, path, requests)
            progress(
                f"transformers done: {h['tokens'] / h['seconds']:.1f} tok/s, {h['seconds']:.1f}s")
    vlm_common.engine_table([("vlinfer", v["tokens"], v["seconds"])] + ([] if h is None else [
        (f"transformers generate (batch {args.hf_batch_size})", h["tokens"], h["seconds"])]))
    if h is not None:
        print(
            f"\nvlinfer / transformers throughput ratio: {h['seconds'] / v['seconds']:.2f}x (same "
            "tokens)"
        )
    breakdown("vlinfer", v)
    decode_share = v["decode"] / v["seconds"]
    print(f"\nvlinfer decode + frame sampling: {decode_share:.1%} of the run (target < 10%)")
    if h is not None:
        breakdown("transformers", h)
        same_ids = sum(a == b for a, b in zip(v["prompt_ids"], h["prompt_ids"]))
        same_all = sum(a == b for a, b in zip(v["outputs"], h["outputs"]))
        print(
            f"\ninputs identical for {same_ids}/{len(requests)} clips (frames, timestamps, "
            "placeholders); greedy "
            f"outputs agree on all tokens for {same_all}/{len(requests)} (random bf16 weights: "
            "near-tied logits)"
        )
    return 0
