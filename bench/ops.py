"""Per-op timings: the pure-torch reference vs the device implementation chosen for this machine, in one run.

    python bench/ops.py     # CPU: paged decode attention, prefill+decode mix, cache write, rotary, norms, SiLU-and-
                            # multiply, GELU, vision attention, linear (prepacked weights)
"""
import argparse
import itertools
import sys
import time

import torch

from vlinfer.ops import reference
from vlinfer.ops.dispatch import active, select


def timed(fn, repeat):
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def paged_case(q_lens, kv_lens, heads, kv_heads, head_dim, block_size, dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks = sum((n + block_size - 1) // block_size for n in kv_lens) + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max((n + block_size - 1) // block_size for n in kv_lens)
    tables = torch.full((len(kv_lens), max_blocks), -1, dtype=torch.int32)
    for i, n in enumerate(kv_lens):
        nb = (n + block_size - 1) // block_size
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), tables, head_dim ** -0.5


def linear_rows(dtype, repeat):
    """F.linear vs the implementation's linear on weights it prepared (prepare_weights), decode and prefill sizes."""
    from vlinfer.layers import ReplicatedLinear
    from vlinfer.ops import dispatch
    rows = []
    dt = str(dtype).replace("torch.", "")
    for tokens, in_features, out_features in [(32, 2048, 6144), (32, 6144, 2048), (768, 2048, 6144)]:
        layer = ReplicatedLinear(in_features, out_features).to(dtype)
        layer.weight.data.normal_(0, 0.02)
        plain = layer.weight.data.clone()
        dispatch.prepare_weights(layer)
        x = torch.randn(tokens, in_features).to(dtype)
        rows.append((f"linear {tokens} x {in_features} -> {out_features} {dt}",
                     timed(lambda: reference.linear(x, plain), repeat),
                     timed(lambda: active.impl["linear"](x, layer.weight), repeat)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args(argv)
    name = select(args.device)
    impl = active.impl
    print(f"device implementation: {name}; torch threads {torch.get_num_threads()}")
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        dt = str(dtype).replace("torch.", "")
        for batch, ctx, heads, kv_heads, head_dim in [(32, 1024, 16, 8, 128), (32, 1024, 9, 3, 64),
                                                      (64, 256, 9, 3, 64), (8, 4096, 16, 2, 128)]:
            case = paged_case([1] * batch, [ctx] * batch, heads, kv_heads, head_dim, 16, dtype)
            label = f"paged decode attention b={batch} ctx={ctx} h={heads}/{kv_heads} d={head_dim} {dt}"
            rows.append((label, timed(lambda: reference.paged_attention(*case), args.repeat),
                         timed(lambda: impl["paged_attention"](*case), args.repeat)))
        case = paged_case([1] * 24 + [256, 128], [512] * 24 + [256, 640], 9, 3, 64, 16, dtype)
        rows.append((f"paged attention mix 24 decodes + 2 prefill chunks {dt}",
                     timed(lambda: reference.paged_attention(*case), args.repeat),
                     timed(lambda: impl["paged_attention"](*case), args.repeat)))
        for q_lens, kv_lens, label in [([256] * 8, [256] * 8, "8 prefill chunks of 256"),
                                       ([512], [1024], "prefill 512 after 512 cached")]:
            case = paged_case(q_lens, kv_lens, 16, 8, 128, 16, dtype)
            rows.append((f"paged attention {label} h=16/8 d=128 {dt}",
                         timed(lambda: reference.paged_attention(*case), args.repeat),
                         timed(lambda: impl["paged_attention"](*case), args.repeat)))
        key = torch.randn(2048, 8, 128).to(dtype)
        caches = [torch.zeros(200, 16, 8, 128, dtype=dtype) for _ in range(2)]
        slots = torch.randperm(200 * 16)[:2048]
        rows.append((f"cache write 2048 tokens h=8 d=128 {dt}",
                     timed(lambda: reference.store_kvcache(key, key, *caches, slots), args.repeat),
                     timed(lambda: impl["store_kvcache"](key, key, *caches, slots), args.repeat)))
        qkv = torch.randn(2048, 32 * 128).to(dtype)
        q, k = qkv[:, :16 * 128].view(2048, 16, 128), qkv[:, 16 * 128:24 * 128].view(2048, 8, 128)
        cos, sin = torch.rand(2048, 128), torch.rand(2048, 128)
        rows.append((f"rotary 2048 tokens q16/k8 d=128 {dt}",
                     timed(lambda: reference.apply_rotary(q, k, cos, sin), args.repeat),
                     timed(lambda: impl["apply_rotary"](q, k, cos, sin), args.repeat)))
        x, residual = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
        weight = (torch.rand(2048) + 0.5).to(dtype)
        rows.append((f"rms_norm 2048 x 2048 {dt}", timed(lambda: reference.rms_norm(x, weight, 1e-6), args.repeat),
                     timed(lambda: impl["rms_norm"](x, weight, 1e-6), args.repeat)))
        rows.append((f"add_rms_norm 2048 x 2048 {dt}",
                     timed(lambda: reference.add_rms_norm(x, residual, weight, 1e-6), args.repeat),
                     timed(lambda: impl["add_rms_norm"](x, residual, weight, 1e-6), args.repeat)))
        head_weight = (torch.rand(128) + 0.5).to(dtype)
        rows.append((f"per-head rms_norm (q/k norm) 2048 tokens x 16 heads d=128 {dt}",
                     timed(lambda: reference.rms_norm(q, head_weight, 1e-6), args.repeat),
                     timed(lambda: impl["rms_norm"](q, head_weight, 1e-6), args.repeat)))
        gate_up = torch.randn(2048, 2 * 6144).to(dtype)
        rows.append((f"silu_and_mul 2048 x 6144 {dt}", timed(lambda: reference.silu_and_mul(gate_up), args.repeat),
                     timed(lambda: impl["silu_and_mul"](gate_up), args.repeat)))
        fc1 = torch.randn(2048, 4096).to(dtype)
        rows.append((f"gelu_tanh 2048 x 4096 {dt}", timed(lambda: reference.gelu_tanh(fc1), args.repeat),
                     timed(lambda: impl["gelu_tanh"](fc1.clone()), args.repeat)))  # in place: a fresh input
        if dtype == torch.bfloat16:  # float32 stays on SDPA
            for n in (256, 1024, 2352):  # one Qwen3-VL-2B image's patches (16 heads of 64)
                vq, vk, vv = torch.randn(n, 3, 16, 64).to(dtype).unbind(1)
                cu = torch.tensor([0, n], dtype=torch.int32)
                rows.append((f"vision attention {n} patches h=16 d=64 {dt}",
                             timed(lambda: reference.varlen_attention(vq, vk, vv, cu, 0.125), args.repeat),
                             timed(lambda: impl["varlen_attention"](vq, vk, vv, cu, 0.125), args.repeat)))
        rows.extend(linear_rows(dtype, args.repeat))
    print(f"\n| op and shape | reference (ms) | {name} (ms) | speedup |\n|---|---|---|---|")
    for label, ref_ms, dev_ms in rows:
        print(f"| {label} | {ref_ms:.2f} | {dev_ms:.2f} | {ref_ms / dev_ms:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
