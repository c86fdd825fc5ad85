"""Decode attention over a compressed KV cache (kv_cache_dtype), one layer of one decode step, on
this CPU's best kernel level: each cache dtype's time, the bytes of stored rows (and int8 scales) it
reads, that as GB/s and as a share of this machine's read bandwidth measured in the same run, and
its speed against a cache of the compute dtype.

    python bench/kv_cache_attention.py                       # SmolLM2's shape: 32 sequences x 1,700
    tokens,
                                                             # 9 query heads on 3 KV heads of 64,
                                                             float32 queries
    python bench/kv_cache_attention.py --head-dim 128 --heads 16 --kv-heads 8 --dtype bfloat16
    python bench/kv_cache_attention.py --layers 30 --scattered  # as in the engine: one step's 30
    layers of
                                                                # caches, past the L3, blocks
                                                                scattered

One layer's cache (25-100 MB here) can stay in a large L3 between repeats; an engine step reads
every layer's cache once, from DRAM, through blocks the pool hands out in any order. --layers N
times N layers' caches in turn (each its own tensors), --scattered shuffles the block tables and
draws each sequence's length from 0.65-1.35x --context.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from vlinfer.config import KV_CACHE_DTYPES  # noqa: E402
from vlinfer.ops.cpu import CpuOps  # noqa: E402


def timed_ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--context", type=int, default=1700)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--layers", type=int, default=1,
                   help="layers of caches, timed in turn (per layer in the table)")
    p.add_argument("--scattered", action="store_true",
                   help="shuffled block tables, lengths 0.65-1.35x --context")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    ops = CpuOps()
    print(f"machine: {common.machine()}; kernels {ops.name} level {ops.isa}")
    read_gbs, _ = common.bandwidth_gbs()
    b, ctx, kvh, d, bs = args.sequences, args.context, args.kv_heads, args.head_dim, args.block_size
    g = torch.Generator().manual_seed(0)
    if args.scattered:
        lens = torch.randint(int(ctx * 0.65),
                             int(ctx * 1.35) + 1, (b, ), generator=g, dtype=torch.int32)
    else:
        lens = torch.full((b,), ctx, dtype=torch.int32)
    per_seq = -(-int(lens.max()) // bs)
    num_blocks = b * per_seq
    order = torch.randperm(num_blocks, generator=g) if args.scattered else torch.arange(num_blocks)
    tables = order.to(torch.int32).view(b, per_seq)
    cu = torch.arange(b + 1, dtype=torch.int32)
    q = torch.randn(b, args.heads, d, generator=g).to(dtype)
    tokens = int(lens.sum())

    def layer_caches(make):
        """args.layers caches from make(k_rows, v_rows), each from its own random rows."""
        caches = []
        for _ in range(args.layers):
            rows = [torch.randn(num_blocks * bs, kvh, d, generator=g).to(dtype) for _ in range(2)]
            caches.append(make(*rows))
        return caches

    def per_layer_ms(caches, attend):
        return timed_ms(lambda: [attend(c) for c in caches], args.repeat) / len(caches)

    rows = []
    caches = layer_caches(lambda k, v:
                          (k.view(num_blocks, bs, kvh, d), v.view(num_blocks, bs, kvh, d)))
    base_ms = per_layer_ms(caches, lambda c: ops.paged_attention(q, *c, cu, lens, tables, 0.125))
    del caches
    base_bytes = 2 * tokens * kvh * d * dtype.itemsize
    rows.append((f"{args.dtype} (auto)", f"{base_ms:.2f}", f"{base_bytes / 1e6:.0f}",
                 f"{base_bytes / base_ms / 1e6:.1f}",
                 f"{base_bytes / base_ms / 1e6 / read_gbs:.0%}", "1.00x"))
    for name in ("int8", "bfloat16", "float16", "fp8", "fp8_e5m2"):
        cache_dtype = KV_CACHE_DTYPES[name]
        if cache_dtype == dtype:
            continue
        per_row = cache_dtype == torch.int8

        def compressed(k_rows, v_rows):
            k_cache = torch.empty(num_blocks, bs, kvh, d, dtype=cache_dtype)
            v_cache = torch.empty_like(k_cache)
            scales = [
                torch.ones(num_blocks, bs, kvh) if per_row else torch.tensor(1.0) for _ in range(2)
            ]
            ops.store_quantized_kvcache(k_rows, v_rows, k_cache, v_cache, *scales,
                                        torch.arange(num_blocks * bs))
            return k_cache, v_cache, *scales
        caches = layer_caches(compressed)
        ms = per_layer_ms(caches,
                          lambda c: ops.quantized_paged_attention(q, *c, cu, lens, tables, 0.125))
        del caches
        stored = 2 * tokens * kvh * (d * cache_dtype.itemsize + (4 if per_row else 0))
        rows.append((name, f"{ms:.2f}", f"{stored / 1e6:.0f}", f"{stored / ms / 1e6:.1f}",
                     f"{stored / ms / 1e6 / read_gbs:.0%}", f"{base_ms / ms:.2f}x"))
    layout = (f"lengths {int(lens.min())}-{int(lens.max())}, block tables shuffled"
              if args.scattered else f"{ctx} tokens each, blocks in order")
    print(
        f"\none decode step of one layer (time per layer over {args.layers} layers' caches timed "
        f"in turn): {b} "
        f"sequences, {tokens} tokens ({layout}), {args.heads} query heads on {kvh} KV heads of "
        f"{d}, {args.dtype} "
        f"queries; read bandwidth {read_gbs:.1f} GB/s (a 1 GiB sum, best of 5, this run)")
    common.table(["KV cache", "ms", "MB read", "GB/s", "of read bandwidth", f"vs {args.dtype}"],
                 rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
