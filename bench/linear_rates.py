"""Linear layers on this CPU: F.linear on the plain weight (MKL's sgemm in float32) beside the
packed layout the engine's decoder linears run (ops/cpu/backend.py pack_linear_weight), per row
count, in one run; then what those rates allow the standard batch of bench/throughput.py: every
linear of the model at the faster kernel for its row count and nothing else (attention, norms,
sampling, the engine's Python) taking any time.

    python bench/linear_rates.py                      # Qwen3-VL-2B's vision and decoder shapes,
    then SmolLM2's batch
    python bench/linear_rates.py --skip-shapes        # only the standard batch's ceiling
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import machine, matmul_peak_gflops, model_dims, table, text_workload  # noqa: E402
from ops import timed  # noqa: E402

# (in, out) features: Qwen3-VL-2B's vision tower (qkv, fc1, fc2) and decoder (gate_up, down)
SHAPES = [(1024, 3072), (1024, 4096), (4096, 1024), (2048, 6144), (6144, 2048)]
ROWS = (64, 256, 784, 3152)
PREFILL_ROWS = 2048  # the standard batch's prefill steps (max_num_batched_tokens)


def kernels(ops, in_features: int, out_features: int, dtype):
    """(F.linear on the plain weight, our linear on the layout the engine packs a decoder's weight
    in: oneDNN's, or our panels where this CPU takes them) as functions of the input."""
    weight = (torch.randn(out_features, in_features) * 0.02).to(dtype)
    packed = ops.pack_linear_weight(weight)
    return (lambda x: F.linear(x, weight)), (lambda x: ops.linear(x, packed))


def shape_table(ops, dtype, repeats: int) -> None:
    rows_out = []
    for k, n in SHAPES:
        plain, packed = kernels(ops, k, n, dtype)
        for m in ROWS:
            x = torch.randn(m, k).to(dtype)
            a, b = timed(lambda: plain(x), repeats) / 1e3, timed(lambda: packed(x), repeats) / 1e3
            rows_out.append((f"{m} x {k} -> {n}", f"{a * 1e3:.1f}", f"{b * 1e3:.1f}",
                             f"{b / a:.2f}", f"{2 * m * k * n / min(a, b) / 1e9:.0f}"))
    table([
        "rows x in -> out", "F.linear (ms)", "prepacked (ms)", "prepacked / F.linear",
        "best GFLOP/s"
    ], rows_out)


def batch_ceiling(ops, dtype, args, peak: float) -> None:
    """Seconds of the standard batch's linears, each step at the faster kernel for its rows, and the
    MFU that leaves if nothing else took time (the FLOPs counted as bench/throughput.py counts
    them)."""
    d = model_dims(args.model)
    h = d["hidden"]
    per_layer = [(h, d["q_dim"] + 2 * d["kv_dim"]), (d["q_dim"], h), (h, 2 * d["intermediate"]),
                 (d["intermediate"], h)]
    head = (h, d["vocab"])
    funcs = {shape: kernels(ops, *shape, dtype) for shape in per_layer + [head]}

    def step(rows: int, with_head: bool) -> float:
        total = 0.0
        for shape in per_layer + ([head] if with_head else []):
            x = torch.randn(rows, shape[0]).to(dtype)
            best = min(timed(lambda: f(x), args.repeats) for f in funcs[shape]) / 1e3
            total += best * (1 if shape == head else d["layers"])
        return total

    prompts, outputs = text_workload(args)
    prompt_tokens = sum(len(p) for p in prompts)
    # active sequences at each step
    decode_rows = [sum(o > s for o in outputs) for s in range(max(outputs))]
    by_rows = {rows: step(rows, True) for rows in sorted(set(decode_rows))}
    rates = [(rows, 2 * rows * (d["layer_params"] + d["head_params"]) / by_rows[rows] / 1e9)
             for rows in (16, 32, 64) if rows in by_rows]
    prefill = step(PREFILL_ROWS, False) * prompt_tokens / PREFILL_ROWS
    decode = sum(by_rows[rows] for rows in decode_rows)
    flops = 2 * d["layer_params"] * (prompt_tokens +
                                     sum(outputs)) + 2 * d["head_params"] * sum(outputs)
    table(["decode step rows", "linears + LM head, GFLOP/s", "share of the peak"],
          [(rows, f"{rate:.0f}", f"{rate / peak:.0%}") for rows, rate in rates])
    ceiling = flops / (prefill + decode) / 1e9
    print(
        f"\n{args.model} {args.num_requests} requests ({prompt_tokens} prompt tokens, "
        f"{sum(outputs)} output "
        f"tokens): the linears alone take {prefill:.1f} s of prefill ({PREFILL_ROWS}-row steps) "
        f"and {decode:.1f} s "
        f"of decode steps (their LM head included), {flops / 1e12:.2f} TFLOP: {ceiling:.0f} "
        "GFLOP/s, "
        f"{ceiling / peak:.0%} of the peak; a share p of the peak leaves "
        f"flops / (p x peak) - {prefill + decode:.1f} s for everything else (at 70%: "
        f"{flops / (0.7 * peak * 1e9) - prefill - decode:.1f} s)")


def main(argv=None):
    p = common.parser(__doc__)
    common.add_model_arg(p)
    common.add_dtype_arg(p, default="float32", choices=["float32"])
    common.add_text_workload_args(p, num_requests=64, max_output=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-shapes", action="store_true")
    args = p.parse_args(argv)
    from vlinfer.ops.cpu import CpuOps
    ops, dtype = CpuOps(), getattr(torch, args.dtype)
    print(f"machine: {machine()}")
    peak = matmul_peak_gflops(dtype)
    print(f"{args.dtype} matmul peak measured now: {peak:.0f} GFLOP/s ({common.CPU_PEAK_PROBE})\n")
    if not args.skip_shapes:
        shape_table(ops, dtype, args.repeats)
        print()
    batch_ceiling(ops, dtype, args, peak)


if __name__ == "__main__":
    main()
