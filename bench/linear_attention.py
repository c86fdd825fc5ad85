"""Linear attention: the pure-torch reference against our CPU kernels
(ops/cpu/linear_attention.py), one layer's gated delta rule and causal conv1d, in one run: decode
steps per batch size, then a prefill of one sequence per token count (from zeros, its state
written back). Shapes:
Qwen3_5TextConfig's defaults (16 key heads x 128, 32 value heads x 128, conv kernel 4) and
16 / 16 heads x 128, the linear layers of Qwen3.5-0.8B and 2B; float32 state, float32 and bf16
activations.

    python bench/linear_attention.py             # this CPU's best level
    python bench/linear_attention.py --repeat 20 --tokens 512 2048
    python bench/linear_attention.py --batches 1 --tokens 70 --repeat 1   # a quick check
"""
import argparse
import time

import torch

from vlinfer.ops.cpu import CpuOps
from vlinfer.ops.reference import linear_attention as reference

# (name, key heads, value heads, key dim, value dim)
SHAPES = [("16k/32v x 128", 16, 32, 128, 128), ("16k/16v x 128", 16, 16, 128, 128)]
WIDTH = 4


def timed(fn, repeat):
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def decode_case(batch, hk, hv, dk, dv, dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, hk, dk, generator=gen).to(dtype)
    k = torch.randn(batch, hk, dk, generator=gen).to(dtype)
    v = torch.randn(batch, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(batch, hv, generator=gen)
    beta = torch.rand(batch, hv, generator=gen).to(dtype)
    state = torch.randn(batch, hv, dk, dv, generator=gen) * 0.1
    channels = 2 * hk * dk + hv * dv
    x = torch.randn(batch, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, WIDTH, generator=gen).to(dtype)
    conv_state = torch.randn(batch, channels, WIDTH - 1, generator=gen).to(dtype)
    meta = (torch.arange(batch + 1, dtype=torch.int32), torch.randperm(batch, generator=gen),
            torch.ones(batch, dtype=torch.bool))
    return (q, k, v, g, beta, state), (x, weight, None, conv_state), meta


def prefill_case(tokens, hk, hv, dk, dv, dtype):
    """One sequence of `tokens` from zeros: the same tensors as decode_case's, [T, ...]."""
    rule, conv, _ = decode_case(tokens, hk, hv, dk, dv, dtype)
    state = torch.zeros(1, hv, dk, dv)
    conv_state = torch.zeros(1, *conv[3].shape[1:], dtype=dtype)
    meta = (torch.tensor([0, tokens], dtype=torch.int32), torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.bool))
    return (*rule[:5], state), (*conv[:3], conv_state), meta


def table(ops, title, cases, sizes, make, repeat):
    """One row per (shape, dtype, size): the reference's ms, ours, the ratio, for both ops."""
    print(f"{'shape':>14} {'dtype':>5} {title:>6} | {'delta ref':>9} {'ours':>7} {'x':>5} | "
          f"{'conv ref':>8} {'ours':>7} {'x':>5}")
    for (name, hk, hv, dk, dv), dtype in cases:
        for size in sizes:
            rule, conv, (cu, slots, has) = make(size, hk, hv, dk, dv, dtype)
            scale = dk ** -0.5
            times = [
                timed(lambda: fn(*rule, cu, slots, has, scale), repeat)
                for fn in (reference.gated_delta_rule, ops.gated_delta_rule)
            ] + [
                timed(lambda: fn(*conv, cu, slots, has), repeat)
                for fn in (reference.causal_conv1d, ops.causal_conv1d)
            ]
            print(f"{name:>14} {str(dtype)[6:]:>5} {size:>6} | {times[0]:9.3f} {times[1]:7.3f} "
                  f"{times[0] / times[1]:5.1f} | {times[2]:8.3f} {times[3]:7.3f} "
                  f"{times[2] / times[3]:5.1f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args()
    ops = CpuOps()
    print(f"CPU kernels: {ops.isa} ({ops.ext.linear_attention_kernels()}), "
          f"{torch.get_num_threads()} threads; ms per call, one layer")
    cases = [(s, d) for s in SHAPES for d in (torch.float32, torch.bfloat16)]
    table(ops, "batch", cases, args.batches, decode_case, args.repeat)
    table(ops, "tokens", cases, args.tokens, prefill_case, args.repeat)


if __name__ == "__main__":
    main()
