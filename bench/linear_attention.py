"""Linear-attention decode steps: the pure-torch reference against our CPU kernels
(ops/cpu/linear_attention.py), one layer's gated delta rule and causal conv1d per batch size, in
one run. Shapes: Qwen3_5TextConfig's defaults (16 key heads x 128, 32 value heads x 128, conv
kernel 4) and a 16 / 16 head variant; float32 state, float32 and bf16 activations.

    python bench/linear_attention.py             # this CPU's best level
    python bench/linear_attention.py --repeat 20
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    ops = CpuOps()
    print(f"CPU kernels: {ops.isa} ({ops.ext.linear_attention_kernels()}), "
          f"{torch.get_num_threads()} threads; ms per call, one layer")
    print(f"{'shape':>14} {'dtype':>5} {'batch':>5} | {'delta ref':>9} {'ours':>7} {'x':>5} | "
          f"{'conv ref':>8} {'ours':>7} {'x':>5}")
    for (name, hk, hv, dk, dv), dtype in [(s, d) for s in SHAPES
                                          for d in (torch.float32, torch.bfloat16)]:
        for batch in args.batches:
            rule, conv, (cu, slots, has) = decode_case(batch, hk, hv, dk, dv, dtype)
            scale = dk ** -0.5
            times = [
                timed(lambda: fn(*rule, cu, slots, has, scale), args.repeat)
                for fn in (reference.gated_delta_rule, ops.gated_delta_rule)
            ] + [
                timed(lambda: fn(*conv, cu, slots, has), args.repeat)
                for fn in (reference.causal_conv1d, ops.causal_conv1d)
            ]
            print(f"{name:>14} {str(dtype)[6:]:>5} {batch:>5} | {times[0]:9.3f} {times[1]:7.3f} "
                  f"{times[0] / times[1]:5.1f} | {times[2]:8.3f} {times[3]:7.3f} "
                  f"{times[2] / times[3]:5.1f}")


if __name__ == "__main__":
    main()
