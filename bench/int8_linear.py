"""int8 linears against dense ones on this CPU, the linear op alone: per projection shape and row
count, the dense weight on the layout the engine packs it in (ops.pack_linear_weight) against the
same weight quantized per channel as `quantization="int8"` does (ops.pack_quantized_linear("w8a16"),
ops.weight_only_linear: the path the engine runs at that row count), and on the VNNI panels both
paths forced, W8A16 (16-bit activations; bf16 panels widened per call) and W8A8 (per-token int8):
where each leads re-derives int8_panels.WIDEN_ROWS (vlinfer/ops/cpu/int8_panels.py). Then
this machine's bf16 and int8 matmul peaks, measured in the same run: the best of the dense
kernels (oneDNN prepacked, F.linear, our panels) and of the W8A8 panels on 512 rows of 2048 -> 2048.

    python bench/int8_linear.py                          # bf16, SmolLM2's shapes and 2048 -> 8192
    python bench/int8_linear.py --shapes 576x3072 --rows 1,4,64 --repeats 3   # a quick check
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import machine, table  # noqa: E402
from ops import timed  # noqa: E402

# (in, out) features: SmolLM2-135M's fused qkv, gate_up and down projections, and one past the
# caches (16 MiB of int8, 32 MiB of bf16) where decode is bound by the memory's rate
SHAPES = "576x960,576x3072,1536x576,2048x8192"


# the VNNI panels' paths by int8_panels.linear's digits
PATHS = {2: "W8A16 16-bit x", 0: "W8A16 widened bf16", 1: "W8A8"}


def best_ms(fn, repeats: int) -> float:
    return min(timed(fn, repeats) for _ in range(3))


def int8_layer(ops, weight: torch.Tensor) -> dict:
    w = weight.float()
    scale = w.abs().amax(1, keepdim=True) / 127
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return ops.pack_quantized_linear("w8a16", {"weight": q, "weight_scale": scale})


def peaks(ops, dtype, repeats: int) -> tuple[float, float | None]:
    """(dense GFLOP/s, int8 GOP/s) of 512 rows x 2048 -> 2048: the best dense kernel, the W8A8
    panels (None where this build has none)."""
    from vlinfer.ops.cpu import int8_panels
    m, k, n = 512, 2048, 2048
    x, weight = torch.randn(m, k).to(dtype), (torch.randn(n, k) * 0.02).to(dtype)
    dense = [lambda: torch.nn.functional.linear(x, weight)]
    packed = ops.pack_linear_weight(weight)
    if packed is not None:
        dense.append(lambda: ops.linear(x, packed))
    if torch.ops.mkldnn._is_mkldnn_bf16_supported() or dtype == torch.float32:
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        dense.append(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))
    flops = 2 * m * k * n
    dense_rate = max(flops / best_ms(fn, repeats) / 1e6 for fn in dense)
    kernel = int8_layer(ops, weight).get("cpu")
    if kernel is None or kernel["kind"] != "int8_vnni":
        return dense_rate, None
    int8_ms = best_ms(lambda: int8_panels.linear(x, kernel, None, force_digits=1), repeats)
    return dense_rate, flops / int8_ms / 1e6


def main(argv=None):
    p = common.parser(__doc__)
    common.add_dtype_arg(p, choices=["bfloat16", "float32"])
    p.add_argument("--rows", default="1,2,4,8,16,32,48,64,256",
                   type=lambda v: [int(r) for r in v.split(",")])
    p.add_argument("--shapes", default=SHAPES, help="in x out features, comma-separated",
                   type=lambda v: [tuple(map(int, s.split("x"))) for s in v.split(",")])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    from vlinfer.ops.cpu import CpuOps, int8_panels
    ops, dtype = CpuOps(), getattr(torch, args.dtype)
    print(f"machine: {machine()}")
    print(f"int8 layers run {int8_panels.int8_path(ops.ext)}")
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for k, n in args.shapes:
        weight = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
        dense = ops.pack_linear_weight(weight)
        packed = int8_layer(ops, weight)
        kernel = packed.get("cpu") or {}
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            a = best_ms(lambda: ops.linear(x, dense), args.repeats)
            b = best_ms(lambda: ops.weight_only_linear(x, packed, None), args.repeats)
            row = [f"{m} x {k} -> {n}", f"{a * 1e3:.0f}", f"{b * 1e3:.0f}", f"{a / b:.2f}x"]
            if kernel.get("kind") == "int8_vnni":
                path = int8_panels.digits(m, dtype, kernel["policy"])
                forced = [best_ms(lambda: int8_panels.linear(x, kernel, None, force_digits=d),
                                  args.repeats) if d or dtype == torch.bfloat16 else None
                          for d in PATHS]
                row += [PATHS[path]] + [f"{a / t:.2f}x" if t else "-" for t in forced]
            rows_out.append(row)
    head = [f"rows x in -> out ({args.dtype})", "dense (us)", "int8 (us)", "int8 speed-up"]
    if any(len(r) > 4 for r in rows_out):
        head += ["int8 path"] + [f"{name} / dense" for name in PATHS.values()]
    table(head, [r + [""] * (len(head) - len(r)) for r in rows_out])
    dense_rate, int8_rate = peaks(ops, dtype, args.repeats)
    print(f"\npeaks, 512 x 2048 -> 2048, this run: {args.dtype} {dense_rate:.0f} GFLOP/s (best "
          f"dense kernel); int8 " + (f"{int8_rate:.0f} GOP/s (W8A8 VNNI panels), "
                               f"{int8_rate / dense_rate:.2f}x" if int8_rate else
                               "(no VNNI panels in this build)"))


if __name__ == "__main__":
    main()
