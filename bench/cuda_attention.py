"""Our Triton paged attention (vlinfer/ops/cuda/triton/paged_attention.py) on a GPU: checked against
the pure-torch reference over a grid of block sizes, head dims, GQA groups and dtypes, then timed
against the reference's gather decode (ops/cuda/backend.py decode_attention: a matmul over every
sequence's whole block-table width) at batch 1 / 8 / 64 x 2k context and at long contexts (a few
sequences of 8-32k tokens, split-KV on and off), each as a share of the HBM read time of its KV (the
KV bytes over this GPU's copy bandwidth, measured in the same run).

    python bench/cuda_attention.py                    # on a CUDA GPU: the check, then the timings
    TRITON_INTERPRET=1 python bench/cuda_attention.py --device cpu --check-only --small
                                                      # the dry run on a CPU: the check alone, small
                                                      shapes

On a CPU the interpreter gives no performance figure, so --device cpu runs the check only.
"""
import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from paged_batches import CUDA_ATTENTION_TOL as TOL, fp32, make_batch, rel_err  # noqa: E402
from vlinfer.ops import reference  # noqa: E402
from vlinfer.ops.cuda import attention as cuda  # noqa: E402
from vlinfer.ops.cuda.loader import load_triton_module  # noqa: E402


def check(device: str, small: bool) -> list[str]:
    """Rows of the correctness grid: every case against the reference in float32."""
    module = load_triton_module("paged_attention")
    rows = []
    blocks = [16, 64] if small else [16, 32, 64, 128, 256]
    heads = [(64, 1), (80, 4)] if small else [(64, 1), (80, 2), (96, 4), (128, 8), (256, 1)]
    dtypes = [torch.float32, torch.bfloat16
              ] if small else [torch.float32, torch.bfloat16, torch.float16]
    batches = [([1] * 4, [1, 17, 300, 64]), ([7, 1, 40, 1], [7, 200, 60, 33])]
    if not small:
        batches.append(([1] * 2, [4096, 1000]))
    for block_size, (head_dim,
                     gqa), dtype, (q_lens,
                                   kv_lens) in itertools.product(blocks, heads, dtypes, batches):
        args = [
            a.to(device)
            for a in make_batch(q_lens, kv_lens, 2 * gqa, 2, head_dim, block_size, dtype)
        ]
        ours = module.paged_attention(*args, head_dim ** -0.5)
        ref = reference.paged_attention(*fp32(args), head_dim ** -0.5)
        err = rel_err(ours, ref)
        rows.append(
            f"| {block_size} | {head_dim} | {gqa} | {str(dtype)[6:]} | {q_lens} / {kv_lens} | "
            f"{err:.1e} | "
            f"{'ok' if err < TOL[dtype] else 'FAIL'} |")
    return rows


def timed(fn, device: str, repeat: int = 20) -> float:
    fn()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeat


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted as read here: the
    attention only reads its KV, so this is the rate to compare with)."""
    a = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() / timed(lambda: b.copy_(a), device, 5)


def timings(device: str) -> list[str]:
    module = load_triton_module("paged_attention")
    bandwidth = copy_bandwidth(device)
    rows = [f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s"]
    shapes = [(b, 2048) for b in (1, 8, 64)] + [(n, ctx)
                                                for n, ctx in ((1, 32768), (4, 16384), (8, 8192))]
    for num_seqs, ctx in shapes:
        q, k_cache, v_cache, cu, lens, tables = (a.to(device) for a in make_batch(
            [1] * num_seqs, [ctx] * num_seqs, 16, 8, 128, 16, torch.bfloat16))
        kv_bytes = 2 * num_seqs * ctx * 8 * 128 * 2
        ours = timed(lambda: module.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.088),
                     device)
        whole = timed(
            lambda: module.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.088, splits=1),
            device)
        gather = timed(lambda: cuda.decode_attention(q, k_cache, v_cache, lens, tables, 0.088),
                       device)
        floor = kv_bytes / bandwidth
        splits = module.num_splits(num_seqs, num_seqs, 8, tables.shape[1], 16)
        rows.append(
            f"| {num_seqs} x {ctx} | {splits} | {ours * 1e6:.0f} | {whole * 1e6:.0f} | "
            f"{gather * 1e6:.0f} | "
            f"{gather / ours:.1f}x | {ours / floor:.2f}x |")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--small", action="store_true",
                   help="a smaller grid (the CPU dry run under the interpreter)")
    args = p.parse_args(argv)
    print(
        f"device: {args.device}"
        f"{', ' + torch.cuda.get_device_name() if args.device.startswith('cuda') else ''}; "
        f"torch {torch.__version__}")
    rows = check(args.device, args.small)
    failed = sum(r.endswith("FAIL |") for r in rows)
    print(
        "| block size | head dim | GQA | dtype | query / KV lengths | rel. error | "
        "|\n|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))
    print(f"check: {len(rows) - failed} of {len(rows)} cases within tolerance")
    if not args.check_only and args.device.startswith("cuda"):
        lines = timings(args.device)
        print(lines[0])
        print(
            "| sequences x context | splits | ours (us) | ours, no split (us) | gather (us) | "
            "speed-up over the "
            "gather | ours / HBM read time |\n|---|---|---|---|---|---|---|")
        print("\n".join(lines[1:]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
