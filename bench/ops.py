"""Per-op timings: the pure-torch reference vs the device implementation, in one run. On CPU, one
column per kernel level this CPU runs (generic, AVX2, AVX-512, AVX512-BF16: cpu_features.cpu_isa),
each its own build.

    python bench/ops.py     # CPU: paged decode attention, prefill+decode mix, cache write, rotary,
    norms, SiLU-and-
                            # multiply, GELU, vision attention, linear (prepacked weights), GGUF
                            Q4_1 / Q8_0 linears
    python bench/ops.py --levels avx512bf16   # one level only
    python bench/ops.py --gguf-only           # the GGUF linears alone
"""
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from vlinfer.platform import cpu_features
from vlinfer.layers import ModelContext
from vlinfer.ops import reference
from vlinfer.ops.select import select


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
    return q, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), tables, head_dim**-0.5


def linear_rows(dtype, repeat, impls):
    """F.linear vs each implementation's linear on the weight layout it asks for (pack_weight),
    decode and prefill sizes."""
    from vlinfer.layers import ReplicatedLinear
    rows = []
    dt = str(dtype).replace("torch.", "")
    for tokens, in_features, out_features in [(32, 2048, 6144), (32, 6144, 2048),
                                              (768, 2048, 6144)]:
        x = torch.randn(tokens, in_features).to(dtype)
        plain = (torch.randn(out_features, in_features) * 0.02).to(dtype)
        times = []
        for impl in impls:
            layer = ReplicatedLinear(ModelContext(impl), in_features, out_features).to(dtype)
            layer.weight.data.copy_(plain)
            layer.pack_weight()
            times.append(timed(lambda: layer(x), repeat))
        rows.append((f"linear {tokens} x {in_features} -> {out_features} {dt}",
                     timed(lambda: reference.linear(x, plain), repeat), *times))
    return rows


def gguf_rows(repeat, impls):
    """GGUF linears (SmolLM2's gate/up projection in Q4_1, its 49152-token LM head in Q8_0): the
    reference (dequantize + matmul per call) vs each implementation's gguf_linear on the layout its
    pack_gguf_weight makes."""
    import gguf
    from vlinfer.ops.reference import gguf as gguf_reference
    rows = []
    for type_name, ggml_type, out_features, in_features, row_counts in [
        ("Q4_1", 3, 3072, 576, (1, 32, 512)), ("Q8_0", 8, 49152, 576, (1, 32))
    ]:
        dense = torch.randn(out_features, in_features,
                            generator=torch.Generator().manual_seed(0)).numpy()
        blocks = torch.from_numpy(
            gguf.quants.quantize(dense, gguf.GGMLQuantizationType[type_name]).copy())
        packed = [impl.pack_gguf_weight(blocks, ggml_type) for impl in impls]
        for tokens in row_counts:
            x = torch.randn(tokens, in_features)
            times = [
                timed(
                    lambda: impl.gguf_linear(x, weight
                                             if weight is not None else blocks, ggml_type), repeat)
                for impl, weight in zip(impls, packed)
            ]
            rows.append(
                (f"GGUF {type_name} linear {tokens} x {in_features} -> {out_features} float32",
                 timed(lambda: gguf_reference.gguf_linear(x, blocks, ggml_type), repeat), *times))
    return rows


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--levels", nargs="*",
                   help="CPU kernel levels to time (default: every level this CPU runs)")
    p.add_argument("--gguf-only", action="store_true", help="time the GGUF linears only")
    args = p.parse_args(argv)
    if args.device == "cpu":
        from vlinfer.ops.cpu import CpuOps
        best = cpu_features.cpu_isa()
        levels = args.levels or cpu_features.CPU_ISAS[:cpu_features.CPU_ISAS.index(best) + 1]
        impls = [CpuOps(isa=level, bf16_prefill_kernels=True) for level in levels]
        if not CpuOps(isa=best).bf16_prefill_kernels and impls[-1].bf16_attention:
            # AMX: the engine takes SDPA for bf16 prefill and vision attention; time its choice
            # beside our kernels.
            impls.append(CpuOps(isa=best))
    else:
        impls = [select(args.device)]
    names = [impl.describe() for impl in impls]
    print(f"machine: {common.machine()}")
    print(f"implementations: {', '.join(names)}")

    def row(label, ref_fn, op, *op_args, fresh=None):
        """Times the reference, then op on every implementation (fresh(): a new first argument for
        in-place ops)."""
        times = [
            timed(lambda: getattr(impl, op)(*((fresh(), ) if fresh else ()), *op_args), args.repeat)
            for impl in impls
        ]
        rows.append((label, timed(ref_fn, args.repeat), *times))

    rows = []
    for dtype in () if args.gguf_only else (torch.bfloat16, torch.float32):
        dt = str(dtype).replace("torch.", "")
        # b=1: a single stream, its kv heads split over the cores
        # (vlinfer/ops/cpu/csrc/decode_vectors.h DecodeItems)
        for batch, ctx, heads, kv_heads, head_dim in [(32, 1024, 16, 8, 128), (32, 1024, 9, 3, 64),
                                                      (64, 256, 9, 3, 64), (8, 4096, 16, 2, 128),
                                                      (1, 4096, 9, 3, 64), (1, 4096, 16, 8, 128)]:
            case = paged_case([1] * batch, [ctx] * batch, heads, kv_heads, head_dim, 16, dtype)
            label = (f"paged decode attention b={batch} ctx={ctx} h={heads}/{kv_heads} "
                     f"d={head_dim} {dt}")
            row(label, lambda: reference.paged_attention(*case), "paged_attention", *case)
        case = paged_case([1] * 24 + [256, 128], [512] * 24 + [256, 640], 9, 3, 64, 16, dtype)
        row(f"paged attention mix 24 decodes + 2 prefill chunks {dt}",
            lambda: reference.paged_attention(*case), "paged_attention", *case)
        for q_lens, kv_lens, label in [([256] * 8, [256] * 8, "8 prefill chunks of 256"),
                                       ([512], [1024], "prefill 512 after 512 cached")]:
            case = paged_case(q_lens, kv_lens, 16, 8, 128, 16, dtype)
            row(f"paged attention {label} h=16/8 d=128 {dt}",
                lambda: reference.paged_attention(*case), "paged_attention", *case)
        key = torch.randn(2048, 8, 128).to(dtype)
        caches = [torch.zeros(200, 16, 8, 128, dtype=dtype) for _ in range(2)]
        slots = torch.randperm(200 * 16)[:2048]
        row(f"cache write 2048 tokens h=8 d=128 {dt}",
            lambda: reference.store_kvcache(key, key, *caches, slots), "store_kvcache", key, key,
            *caches, slots)
        qkv = torch.randn(2048, 32 * 128).to(dtype)
        q, k = qkv[:, :16 * 128].view(2048, 16, 128), qkv[:, 16 * 128:24 * 128].view(2048, 8, 128)
        cos, sin = torch.rand(2048, 128), torch.rand(2048, 128)
        row(f"rotary 2048 tokens q16/k8 d=128 {dt}", lambda: reference.apply_rotary(q, k, cos, sin),
            "apply_rotary", q, k, cos, sin)
        x, residual = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
        weight = (torch.rand(2048) + 0.5).to(dtype)
        row(f"rms_norm 2048 x 2048 {dt}", lambda: reference.rms_norm(x, weight, 1e-6), "rms_norm",
            x, weight, 1e-6)
        row(f"add_rms_norm 2048 x 2048 {dt}",
            lambda: reference.add_rms_norm(x, residual, weight, 1e-6), "add_rms_norm", x, residual,
            weight, 1e-6)
        head_weight = (torch.rand(128) + 0.5).to(dtype)
        row(f"per-head rms_norm (q/k norm) 2048 tokens x 16 heads d=128 {dt}",
            lambda: reference.rms_norm(q, head_weight, 1e-6), "rms_norm", q, head_weight, 1e-6)
        gate_up = torch.randn(2048, 2 * 6144).to(dtype)
        row(f"silu_and_mul 2048 x 6144 {dt}", lambda: reference.silu_and_mul(gate_up),
            "silu_and_mul", gate_up)
        fc1 = torch.randn(2048, 4096).to(dtype)
        row(f"gelu_tanh 2048 x 4096 {dt}", lambda: reference.gelu_tanh(fc1), "gelu_tanh",
            fresh=fc1.clone)  # in place: a fresh input
        if dtype == torch.bfloat16:  # float32 stays on SDPA
            for n in (256, 1024, 2352):  # one Qwen3-VL-2B image's patches (16 heads of 64)
                vq, vk, vv = torch.randn(n, 3, 16, 64).to(dtype).unbind(1)
                cu = torch.tensor([0, n], dtype=torch.int32)
                row(f"vision attention {n} patches h=16 d=64 {dt}",
                    lambda: reference.varlen_attention(vq, vk, vv, cu, 0.125), "varlen_attention",
                    vq, vk, vv, cu, 0.125)
        rows.extend(linear_rows(dtype, args.repeat, impls))
    rows.extend(gguf_rows(args.repeat, impls))
    common.table(["op and shape", "reference (ms)"] + [f"{name} (ms)"
                                                       for name in names] + ["best speedup"],
                 [(label, f"{ref_ms:.2f}", *(f"{t:.2f}"
                                             for t in dev_ms), f"{ref_ms / min(dev_ms):.1f}x")
                  for label, ref_ms, *dev_ms in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
