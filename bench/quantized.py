"""Quantized weights on CPU: SmolLM2-135M dense float32 and bfloat16, int8 (quantized on load;
float32 and bfloat16 compute), and the Q4_1 GGUF kept in its blocks (our kernels,
vlinfer/ops/cpu/csrc/gguf_blocks.cpp), side by side with llama.cpp on the same Q4_1 file
(llama-cpp-python built from source in .venv-llamacpp by `make peers`; skipped, saying so, when
absent).

Two workloads, greedy, EOS ignored:
- single stream: one 32-token prompt (seeded ids) and 128 new tokens. Each engine runs the prompt
  alone (1 token)
  and the whole request, best of --repeat; decode tok/s = 127 / (whole - prompt alone).
- offline batch: --num-requests requests, prompt and output lengths uniform in [32, 192] (seeded),
  all submitted
  at once (llama.cpp's peer runs them one after another: it decodes one sequence at a time).

A single-stream decode step reads every weight once, so its limit is bandwidth / weight bytes per
step. The bytes per step are counted for each engine's weight format (linear weights and the LM
head: float32 4 bytes a weight, bfloat16 2, int8 34 bytes per 32 (held as Q8_0 blocks of d = 1,
ops/cpu/quant.py) plus a float scale per row, Q4_1 20 bytes per 32 weights, the Q8_0 embedding /
tied LM head 34 per 32). The read bandwidth is measured in the same run (bench/single_stream.py's
sum of a 1 GiB tensor, best of 5, before and after the engines; the higher is used), and each decode
rate is shown as its share of that limit.

Dense and int8 runs load the GGUF dequantized to a float32 safetensors folder (written once by
bench/peers, the same gguf-py dequantization transformers does); the Q4_1 run loads the file itself.

    python bench/quantized.py                                   # the measured run (quiet machine)
    python bench/quantized.py --short                           # a few seconds per engine: proves
    it runs
"""
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import peers  # noqa: E402
from common import bandwidth_gbs, machine, model_dims, progress, table  # noqa: E402
from peers.protocol import time_runs  # noqa: E402

# name -> (model source, dtype, quantization, bytes per linear weight, bytes per LM head weight,
# float32 row scales)
ENGINES = {
    "vlinfer fp32": ("dense", "float32", None, 4.0, 4.0, False),
    "vlinfer bf16": ("dense", "bfloat16", None, 2.0, 2.0, False),
    "vlinfer int8": ("dense", "float32", "int8", 34 / 32, 4.0, True),
    "vlinfer int8 bf16": ("dense", "bfloat16", "int8", 34 / 32, 2.0, True),
    "vlinfer Q4_1 (GGUF blocks)": ("gguf", "float32", None, 20 / 32, 34 / 32, False),
}
LLAMACPP = ("llama.cpp Q4_1", 20 / 32, 34 / 32)


def step_bytes(dims: dict, per_linear: float, per_head: float, row_scales: bool = False) -> float:
    scales = 4 * dims["layers"] * (dims["q_dim"] + 2 * dims["kv_dim"] + dims["hidden"]
                                   + 3 * dims["intermediate"]) if row_scales else 0
    return dims["layer_params"] * per_linear + dims["head_params"] * per_head + scales


def workloads(args):
    rng = random.Random(args.seed)
    prompt = common.token_ids(rng, args.prompt_len)
    lo, hi = args.batch_lens
    batch_prompts = [common.token_ids(rng, rng.randint(lo, hi)) for _ in range(args.num_requests)]
    batch_out = [rng.randint(lo, hi) for _ in range(args.num_requests)]
    single = common.single_stream_runs(prompt, args.output_len, args.repeat)
    batch = [dict(name="batch", prompts=batch_prompts, max_tokens=batch_out, repeat=1)]
    return single, batch


def run_vlinfer(name, args, single, batch):
    from vlinfer import LLM
    source, dtype, quantization = ENGINES[name][:3]
    model = peers.hf_folder(args.model) if source == "dense" else args.model
    start = time.perf_counter()
    llm = LLM(model, dtype=dtype, quantization=quantization, max_model_len=512,
              kv_cache_bytes=args.kv_cache_mib * 2**20)
    load_s = time.perf_counter() - start
    generate = common.greedy(llm)
    generate([[1, 2, 3]], [4])  # warm-up
    result = time_runs(generate, single + ([] if args.skip_batch else batch), tag=f"{name}: ")
    del llm
    return result, f"{name}: load {load_s:.1f}s"


def run_llamacpp(args, single, batch):
    if not peers.usable("llama.cpp", args.model):
        return None
    from vlinfer import loading
    path = loading.resolve_model(args.model).path
    r = peers.try_run("llama.cpp", dict(model=path, threads=torch.get_num_threads(), n_ctx=512,
                                        runs=single + ([] if args.skip_batch else batch)))
    if r is None:
        return None
    return r[
        "runs"], f"llama.cpp {r['version']} on {os.path.basename(path)}: {r.get('system_info', '')}"


def main(argv=None):
    p = common.parser(__doc__)
    common.add_model_arg(p)
    common.add_single_stream_args(p)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--batch-lens", type=int, nargs=2, default=(32, 192))
    p.add_argument("--kv-cache-mib", type=int, default=512)
    common.add_seed_arg(p)
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated subset of: " + ", ".join(ENGINES))
    common.add_skip_args(p, "llama.cpp")
    p.add_argument("--skip-batch", action="store_true")
    p.add_argument("--short", action="store_true",
                   help="16 new tokens, 1 repeat, 4 batch requests of 8-16 tokens")
    args = p.parse_args(argv)
    if args.short:
        args.output_len, args.repeat, args.num_requests, args.batch_lens = 16, 1, 4, (8, 16)
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        p.error(f"unknown engines {unknown}; choose from {list(ENGINES)}")
    single, batch = workloads(args)
    dims = model_dims(args.model)
    print(f"machine: {machine()}")
    print(
        f"single stream: {args.prompt_len} prompt + {args.output_len} tokens, best of "
        f"{args.repeat}; batch: "
        f"{args.num_requests} requests, lengths U{list(args.batch_lens)}; greedy, EOS ignored",
        flush=True)
    bw_before = bandwidth_gbs()
    rows, notes = [], []
    for name in names:
        got = run_vlinfer(name, args, single, batch)
        rows.append((name, got[0], step_bytes(dims, *ENGINES[name][3:])))
        notes.append(got[1])
        progress(f"{name} done")
    if not args.skip_llamacpp:
        got = run_llamacpp(args, single, batch)
        if got is not None:
            rows.append((LLAMACPP[0], got[0], step_bytes(dims, *LLAMACPP[1:])))
            notes.append(got[1])
            progress("llama.cpp done")
    bw_after = bandwidth_gbs()
    read = max(bw_before[0], bw_after[0])

    n = args.output_len
    print(f"\nmachine: {machine()}")
    cells = []
    for name, r, nbytes in rows:
        _, whole, decode = common.decode_rate(r, n)
        limit = read * 1e9 / nbytes
        batch_tps = ("skipped" if "batch" not in r else
                     f"{sum(batch[0]['max_tokens']) / min(r['batch']['seconds']):.1f}")
        cells.append((name, f"{nbytes / 1e6:.1f}", f"{decode:.1f}",
                      f"{decode / limit:.0%} of {limit:.0f}", f"{whole:.2f}", batch_tps))
    table([
        "engine", "weight MB read per decode step", "decode tok/s (single stream)",
        "share of the bandwidth limit", f"{args.prompt_len} + {n} tokens (s)", "batch output tok/s"
    ], cells)
    print(
        f"\nbandwidth: {read:.1f} GB/s read (sum of a 1 GiB float32 tensor, "
        f"{torch.get_num_threads()} threads, best "
        f"of 5; {bw_before[0]:.1f} before the engines, {bw_after[0]:.1f} after); limit = bandwidth "
        "/ weight bytes "
        f"per step ({dims['layer_params'] / 1e6:.1f}M linear weights + "
        f"{dims['head_params'] / 1e6:.1f}M LM head)"
    )
    reference = rows[0][1]["whole"]["outputs"][0]
    for name, r, _ in rows[1:]:
        same = r["whole"]["outputs"][0] == reference
        print(f"greedy {n} tokens vs {rows[0][0]}, {name}: {'identical' if same else 'differ'}")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
