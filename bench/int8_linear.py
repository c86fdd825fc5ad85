"""int8 weight-only linears against dense ones on this CPU, the linear op alone: per SmolLM2-135M
projection shape (hidden 576, intermediate 1536) and row count, the dense weight on the layout the
engine packs it in (ops.pack_linear_weight) against the same weight quantized per channel as
`quantization="int8"` does (ops.pack_quantized_linear("w8a16"), ops.weight_only_linear), in one run:
where int8 loses to the dense weight, per row count (issue 62).

    python bench/int8_linear.py                          # bf16, rows 1..2048
    python bench/int8_linear.py --dtype float32 --rows 1,16,512 --repeats 20
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import machine, table  # noqa: E402
from ops import timed  # noqa: E402

# (in, out) features: SmolLM2-135M's fused qkv, o, gate_up and down projections
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def best_ms(fn, repeats: int) -> float:
    return min(timed(fn, repeats) for _ in range(3))


def int8_layer(ops, weight: torch.Tensor) -> dict:
    w = weight.float()
    scale = w.abs().amax(1, keepdim=True) / 127
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return ops.pack_quantized_linear("w8a16", {"weight": q, "weight_scale": scale})


def main(argv=None):
    p = common.parser(__doc__)
    common.add_dtype_arg(p, choices=["bfloat16", "float32"])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256,512,2048",
                   type=lambda v: [int(r) for r in v.split(",")])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    from vlinfer.ops.cpu import CpuOps
    ops, dtype = CpuOps(), getattr(torch, args.dtype)
    print(f"machine: {machine()}")
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for k, n in SHAPES:
        weight = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
        dense = ops.pack_linear_weight(weight)
        packed = int8_layer(ops, weight)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            a = best_ms(lambda: ops.linear(x, dense), args.repeats)
            b = best_ms(lambda: ops.weight_only_linear(x, packed, None), args.repeats)
            rows_out.append((f"{m} x {k} -> {n}", f"{a * 1e3:.0f}", f"{b * 1e3:.0f}",
                             f"{a / b:.2f}x"))
    table([f"rows x in -> out ({args.dtype})", "dense (us)", "int8 (us)", "int8 speed-up"],
          rows_out)


if __name__ == "__main__":
    main()
