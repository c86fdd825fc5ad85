"""Qwen3.5 (Gated DeltaNet + gated full attention, with vision) on the CPU: vlinfer, transformers
and OpenVINO GenAI side by side in one run, on a checkpoint of the real Qwen3.5-2B or -0.8B shape
with random weights (bench/hybrid_common.py; built once, cached).

Parts (--parts; batch, single and long by default):
- check: one image request in float32 through vlinfer and OpenVINO GenAI (f32, f32 KV): the
  greedy tokens must be the same, so the two run the same model on the same input (on --model
  tiny, whose activations are O(1); at the real shapes the random logits are near-tied).
- batch: seeded random images with a question each (bench/vlm_throughput.py's workload), greedy,
  EOS ignored, every request at once: vlinfer's streaming API, transformers' left-padded batches,
  OpenVINO's ContinuousBatchingPipeline (max_num_batched_tokens set to what our engine resolves),
  each in its deployments: our dtype, and OpenVINO's default (int8 weights, u8 KV) beside its bf16.
- single: one text request (prompt alone, then the whole request; decode tok/s from the
  difference, best of --repeat), and the time to first token of one image request; the decode
  rate is given as a share of the bandwidth limit: this machine's read bandwidth measured in the
  same run over the bytes a step must read (weights, the linear layers' state, the full-attention
  KV of the context; hybrid_common.decode_step_bytes).
- long: vlinfer's decode step at each --contexts length, timed per step, split by forward hooks
  into the linear-attention layers, the full-attention layers and the rest (embedding, final norm,
  LM head, sampling, scheduling): the linear share stays flat, the full-attention share grows.

OpenVINO runs in its own venv (`make peers`); the checkpoint is exported to OpenVINO IR on first
use and cached (bench/peers openvino_ir; minutes and ~15 GB for the 2B shape). Without the venv
the benchmark says so and runs the rest. Precision is set on both sides and printed in each row.

    python bench/hybrid_throughput.py --model qwen3.5-2b
    python bench/hybrid_throughput.py --model qwen3.5-0.8b --parts batch,single
    python bench/hybrid_throughput.py --model qwen3.5-2b --parts long --contexts 1024,8192,32768
    python bench/hybrid_throughput.py --model tiny --parts check --max-tokens 12
    python bench/hybrid_throughput.py --model tiny --num-requests 2 --max-tokens 4 \\
        --single-output-len 4 --repeat 1 --contexts 64,128 --long-steps 2   # a quick check
"""
import gc
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import hybrid_common  # noqa: E402
import peers  # noqa: E402
import vlm_throughput  # noqa: E402
from common import bandwidth_gbs, machine, progress, table  # noqa: E402
from vlm_throughput import PROMPT, picture  # noqa: E402

TEXT_PROMPT = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a "
               "message in a bottle, in plain words.<|im_end|>\n<|im_start|>assistant\n")
# OpenVINO deployments: name -> (export weight format, KV_CACHE_PRECISION); the inference
# precision follows --dtype. "int8" is its default deployment of a model over 1B parameters.
OPENVINO = {"dense": ("fp32", None), "int8": ("int8", "u8")}
OV_PRECISION = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def openvino_rows(args, path) -> list[tuple[str, str, dict]]:
    """(row name, IR folder, the request's precision fields) per deployment asked for and
    exported; [] with a printed line when the venv is absent or --skip-openvino."""
    if args.skip_openvino:
        return []
    if peers.python("openvino") is None:
        print(peers.not_installed("openvino"), flush=True)
        return []
    precision = OV_PRECISION[args.dtype]
    rows = []
    for name in args.openvino.split(","):
        weights, kv = OPENVINO[name]
        ir = peers.try_openvino_ir(path, weights)
        if ir is None:
            continue
        fields = dict(precision=precision, kv_cache_precision=kv or precision,
                      threads=torch.get_num_threads())
        label = (f"OpenVINO GenAI, {weights} weights, {precision} compute, "
                 f"{fields['kv_cache_precision']} KV")
        rows.append((label, ir, fields))
    return rows


def save_images(requests, folder: str) -> list[str]:
    """The workload's images as PNG (lossless: the same pixels for the peer)."""
    paths = []
    for i, (_, image) in enumerate(requests):
        paths.append(os.path.join(folder, f"{i}.png"))
        image.save(paths[-1])
    return paths


# -------------------------------------------------------------------------------------------------
# batch

def batch(args, path) -> None:
    from vlinfer.multimodal import Qwen3VLImageProcessor
    requests = vlm_throughput.make_workload(args)
    proc = Qwen3VLImageProcessor.from_pretrained(path)
    image_tokens = [proc.num_image_tokens(im.height, im.width) for _, im in requests]
    max_model_len = -(-(max(image_tokens) + 64 + args.max_tokens) // 256) * 256
    print(f"\nbatch: {len(requests)} requests, one image each ({args.min_image_size} to "
          f"{args.max_image_size}, {sum(image_tokens)} image tokens), {args.max_tokens} output "
          "tokens each (greedy, EOS ignored)", flush=True)
    pool = hybrid_common.pool_bytes(path, args.dtype,
                                    [n + 64 + args.max_tokens for n in image_tokens])
    v = vlm_throughput.run_vlinfer(args, path, requests, max_model_len, kv_cache_bytes=pool,
                                   max_num_seqs=len(requests))
    batched = v["max_num_batched_tokens"]
    rows = [(f"vlinfer, {args.dtype}, {args.dtype} KV", v["tokens"], v["seconds"],
             v["ttft_mean"], v["ttft_max"], v["outputs"])]
    progress(f"vlinfer done: {v['tokens'] / v['seconds']:.1f} tok/s")
    if not args.skip_transformers:
        h = vlm_throughput.run_transformers(args, path, requests)
        rows.append((f"transformers generate (batch {args.hf_batch_size}), {args.dtype}",
                     h["tokens"], h["seconds"], None, None, h["outputs"]))
        progress(f"transformers done: {h['tokens'] / h['seconds']:.1f} tok/s")
    with tempfile.TemporaryDirectory(prefix="vlinfer-bench-images-") as tmp:
        images = save_images(requests, tmp)
        for label, ir, fields in openvino_rows(args, path):
            run = dict(name="batch", kind="batch", prompts=[t for t, _ in requests],
                       images=[[p] for p in images], max_tokens=[args.max_tokens] * len(requests),
                       repeat=1)
            r = peers.try_run("openvino", dict(fields, model=ir, max_num_batched_tokens=batched,
                                               max_num_seqs=len(requests),
                                               cache_size_gb=args.openvino_cache_gb, runs=[run]))
            if r is None:
                continue
            b = r["runs"]["batch"]
            rows.append((label, sum(map(len, b["outputs"])), b["seconds"][0],
                         sum(b["ttft"]) / len(b["ttft"]), max(b["ttft"]), b["outputs"]))
            progress(f"{label} done ({r['version']}; start-up {r['startup_s']:.1f}s not timed)")
    print(f"\nmachine: {machine()}")
    table(["engine", "output tokens", "time (s)", "output tok/s", "TTFT mean (s)", "TTFT max (s)"],
          [(name, tokens, f"{s:.1f}", f"{tokens / s:.1f}",
            "" if mean is None else f"{mean:.1f}", "" if top is None else f"{top:.1f}")
           for name, tokens, s, mean, top, _ in rows])
    print(f"\nvlinfer resolved max_num_batched_tokens={batched}; OpenVINO's "
          "ContinuousBatchingPipeline ran with the same")
    for name, tokens, seconds, _, _, outputs in rows[1:]:
        first = sum(a[:1] == b[:1] for a, b in zip(rows[0][5], outputs))
        print(f"vlinfer / {name}: {rows[0][1] / rows[0][2] / (tokens / seconds):.2f}x throughput; "
              f"greedy first token agrees on {first}/{len(outputs)}")


# -------------------------------------------------------------------------------------------------
# single stream

def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def single(args, path) -> None:
    from vlinfer import LLM, SamplingParams
    n, repeat = args.single_output_len, args.repeat
    image = picture(*vlm_throughput.parse_size(args.max_image_size), 10 ** 6 + 1)
    image_prompt = {"prompt": PROMPT.format(question="Describe this image."),
                    "multi_modal_data": {"image": [image]}}
    bw_before = bandwidth_gbs()
    llm = LLM(path, dtype=args.dtype, max_model_len=4096, max_num_seqs=1,
              kv_cache_bytes=hybrid_common.pool_bytes(path, args.dtype, [4096]))

    def gen(prompt, k):
        params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        return llm.generate([prompt], params, use_tqdm=False)[0]

    gen(image_prompt, 2)  # warm-up: the whole path
    prompt_len = len(gen(TEXT_PROMPT, 1).prompt_token_ids)
    rows = {"vlinfer": (best_of(lambda: gen(TEXT_PROMPT, 1), repeat),
                        best_of(lambda: gen(TEXT_PROMPT, n), repeat),
                        best_of(lambda: gen(image_prompt, 1), repeat))}
    ours_tokens = list(gen(TEXT_PROMPT, n).outputs[0].token_ids)
    del llm
    gc.collect()
    progress("vlinfer done")
    if not args.skip_transformers:
        rows["transformers"] = transformers_single(args, path, image, n, repeat)
        progress("transformers done")
    with tempfile.TemporaryDirectory(prefix="vlinfer-bench-images-") as tmp:
        image_path = os.path.join(tmp, "image.png")
        image.save(image_path)
        for label, ir, fields in openvino_rows(args, path):
            runs = [dict(name="prompt", kind="single", prompts=[TEXT_PROMPT], max_tokens=[1],
                         repeat=repeat),
                    dict(name="whole", kind="single", prompts=[TEXT_PROMPT], max_tokens=[n],
                         repeat=repeat),
                    dict(name="image", kind="single", prompts=[image_prompt["prompt"]],
                         images=[[image_path]], max_tokens=[1], repeat=repeat)]
            r = peers.try_run("openvino", dict(fields, model=ir, runs=runs))
            if r is not None:
                rows[label] = tuple(min(r["runs"][k]["seconds"])
                                    for k in ("prompt", "whole", "image"))
                progress(f"{label} done")
    bw_after = bandwidth_gbs()
    read = max(bw_before[0], bw_after[0])
    t = hybrid_common.text_config(path)
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    step = hybrid_common.decode_step_bytes(t, element, element, prompt_len + n // 2)
    limit = read * 1e9 / sum(step.values())
    print(f"\nmachine: {machine()}")
    cells = []
    for name, (first, whole, image_ttft) in rows.items():
        decode = (n - 1) / (whole - first)
        cells.append((name, f"{first:.3f}", f"{whole:.2f}", f"{decode:.1f}",
                      f"{decode / limit:.0%}", f"{image_ttft:.2f}"))
    table(["engine", f"text prompt ({prompt_len} tokens) + first token (s)",
           f"prompt + {n} tokens (s)", "decode tok/s", "share of the bandwidth limit",
           "one image request, time to first token (s)"], cells)
    print(f"\nbandwidth limit: {limit:.1f} decode steps/s = {read:.1f} GB/s read (sum of a 1 GiB "
          f"float32 tensor, best of 5; {bw_before[0]:.1f} before, {bw_after[0]:.1f} after) / "
          f"{sum(step.values()) / 1e6:.1f} MB a step ("
          + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in step.items())
          + f"; weights in {args.dtype}, state float32, KV at {prompt_len + n // 2} tokens); "
          f"image {image.width}x{image.height}; vlinfer's greedy tokens: {ours_tokens[:8]}...")


def transformers_single(args, path, image, n, repeat):
    from transformers import AutoTokenizer
    import vlm_common
    model = vlm_common.hf_model(path, args.dtype, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(TEXT_PROMPT, return_tensors="pt").input_ids
    text = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                mm_token_type_ids=torch.zeros_like(ids, dtype=torch.int32))

    def gen(inputs, k):
        vlm_common.hf_generate(model, inputs, k, "cpu")

    prepare = vlm_throughput.transformers_inputs(path)
    image_request = [(PROMPT.format(question="Describe this image."), image)]
    gen(text, 2)
    # the image request's time includes its preprocessing, as vlinfer's and OpenVINO's do
    out = (best_of(lambda: gen(text, 1), repeat), best_of(lambda: gen(text, n), repeat),
           best_of(lambda: gen(prepare(image_request)[1], 1), repeat))
    del model
    gc.collect()
    return out


# -------------------------------------------------------------------------------------------------
# long context

class KindTimer:
    """Forward hooks on every decoder layer adding its wall time to its layer kind, for forwards
    of one token only (decode steps of one sequence); CPU ops are synchronous, so the wall time
    between a layer's pre-hook and hook is its time."""

    def __init__(self, model):
        from vlinfer.models.qwen3_5 import Qwen3_5DecoderLayer
        self.seconds, self.handles, self.started = {}, [], {}
        for layer in model.modules():
            if isinstance(layer, Qwen3_5DecoderLayer):
                self.handles.append(layer.register_forward_pre_hook(self.pre))
                self.handles.append(layer.register_forward_hook(self.post))

    def pre(self, layer, inputs):
        if inputs[1].shape[0] == 1:  # (rope, hidden_states, residual): one token
            self.started[id(layer)] = time.perf_counter()

    def post(self, layer, inputs, output):
        start = self.started.pop(id(layer), None)
        if start is not None:
            kind = layer.layer_type
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start

    def remove(self):
        for h in self.handles:
            h.remove()


def long_context(args, path) -> None:
    from vlinfer import LLM, SamplingParams
    contexts = [int(c) for c in args.contexts.split(",")]
    longest = max(contexts) + args.long_steps + 16
    llm = LLM(path, dtype=args.dtype, max_model_len=longest, max_num_seqs=1,
              kv_cache_bytes=hybrid_common.pool_bytes(path, args.dtype, [longest]))
    engine = llm.engine
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    timer = KindTimer(engine.model_runner.model)
    rng = random.Random(args.seed)
    t = hybrid_common.text_config(path)
    full, linear = hybrid_common.num_full_layers(t), len(t["layer_types"])
    linear -= full
    rows = []
    for context in contexts:
        params = SamplingParams(temperature=0, max_tokens=args.long_steps + 1, ignore_eos=True)
        engine.add_request(common.token_ids(rng, context), params)
        steps, started = [], False
        while engine.has_unfinished_requests():
            if started:
                timer.seconds = {}
            start = time.perf_counter()
            outs = engine.step()
            if started:
                steps.append((time.perf_counter() - start, dict(timer.seconds)))
            started = started or any(o.outputs[0].token_ids for o in outs)
        best = min(steps, key=lambda s: s[0])
        step, kinds = best
        lin, att = kinds.get("linear_attention", 0.0), kinds.get("full_attention", 0.0)
        rows.append((context, step, lin, att))
        progress(f"context {context}: decode step {step * 1e3:.1f} ms "
                 f"(best of {len(steps)})")
    timer.remove()
    del engine, llm
    gc.collect()
    print(f"\nmachine: {machine()}")
    table(["context (tokens)", "decode step (ms)", f"{linear} linear-attention layers (ms)",
           f"{full} full-attention layers (ms)", "rest (ms)", "linear share",
           "full-attention share"],
          [(c, f"{s * 1e3:.1f}", f"{lin * 1e3:.1f}", f"{att * 1e3:.1f}",
            f"{(s - lin - att) * 1e3:.1f}", f"{lin / s:.0%}", f"{att / s:.0%}")
           for c, s, lin, att in rows])
    print("\neach layer's time includes its MLP; rest: embedding, final norm, LM head, sampling "
          f"and scheduling; best of {args.long_steps} decode steps per context, {args.dtype}")


# -------------------------------------------------------------------------------------------------
# correctness of the comparison

def check(args, path) -> None:
    """vlinfer and OpenVINO GenAI (its fp32 export run in f32, f32 KV) on the same image request
    in float32: the greedy tokens must be the same (run it on --model tiny: a tiny checkpoint has
    O(1) activations, so the tokens are not near-tied)."""
    from vlinfer import LLM, SamplingParams
    n = args.max_tokens
    image = picture(320, 256, 7)
    prompt = PROMPT.format(question="Describe this image.")
    llm = LLM(path, dtype="float32", max_model_len=1024, max_num_seqs=2,
              kv_cache_bytes=hybrid_common.pool_bytes(path, "float32", [1024, 1024]))
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [image]}}],
                       SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0]
    ours = list(out.outputs[0].token_ids)
    del llm
    gc.collect()
    print(f"\ncheck: vlinfer float32, {len(out.prompt_token_ids)} prompt tokens, greedy {ours}")
    if args.skip_openvino or peers.python("openvino") is None:
        print(peers.not_installed("openvino"), flush=True)
        return
    ir = peers.try_openvino_ir(path, "fp32")
    with tempfile.TemporaryDirectory(prefix="vlinfer-bench-images-") as tmp:
        image_path = os.path.join(tmp, "image.png")
        image.save(image_path)
        runs = [dict(name="batch", kind="batch", prompts=[prompt], images=[[image_path]],
                     max_tokens=[n], repeat=1)]
        r = ir and peers.try_run("openvino", dict(model=ir, precision="f32",
                                                  kv_cache_precision="f32",
                                                  max_num_batched_tokens=2048, cache_size_gb=1,
                                                  runs=runs))
    if r:
        theirs = r["runs"]["batch"]["outputs"][0]
        print(f"check: OpenVINO GenAI {r['version']} f32, f32 KV: greedy {theirs}: "
              f"{'identical' if theirs == ours else 'DIFFERENT'}")


# -------------------------------------------------------------------------------------------------
# main

def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--model", default="qwen3.5-2b", choices=sorted(hybrid_common.SHAPES))
    p.add_argument("--checkpoint", default=None,
                   help="random checkpoint folder "
                   "(default ~/.cache/vlinfer/bench-qwen3.5-<shape>-random)")
    common.add_dtype_arg(p)
    p.add_argument("--parts", default="batch,single,long")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--min-image-size", default="224x224", help="WxH")
    p.add_argument("--max-image-size", default="896x672", help="WxH")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--single-output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--long-steps", type=int, default=8)
    common.add_seed_arg(p)
    common.add_transformers_args(p, batch_size=8)
    p.add_argument("--skip-openvino", action="store_true")
    p.add_argument("--openvino", default="dense,int8",
                   help="OpenVINO deployments: dense (fp32 export, run in --dtype) and int8 "
                   "(int8 weights, u8 KV: its default deployment)")
    p.add_argument("--openvino-cache-gb", type=float, default=4,
                   help="the ContinuousBatchingPipeline's cache_size")
    args = p.parse_args(argv)
    args.device = "cpu"
    path = hybrid_common.ensure_checkpoint(args.checkpoint, args.model, args.seed)
    print(f"machine: {machine()}")
    print(f"model: {args.model} shape, random weights, {path}; vlinfer and transformers in "
          f"{args.dtype}", flush=True)
    parts = args.parts.split(",")
    for name, fn in (("check", check), ("batch", batch), ("single", single),
                     ("long", long_context)):
        if name in parts:
            fn(args, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
