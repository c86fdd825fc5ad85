"""Should the CPU decode step run under torch.compile? One decode step of a fixed batch, timed eager
(our compiled kernels, oneDNN-prepacked linears) and under torch.compile (inductor, our kernels
registered as torch custom ops so the graph has no breaks), each in its own process, in one run. The
engine's CPU graph mode follows this table: it stays eager unless compile wins.

    python bench/cpu_decode_compile.py                    # SmolLM2-135M bf16, batch 64, contexts
    100-300
    python bench/cpu_decode_compile.py --batch 16 --steps 5
"""
import argparse
import os
import random
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import machine, table  # noqa: E402


def register_kernels_as_custom_ops(runner, variant: str) -> None:
    """torch.compile cannot trace through our pybind kernels; as custom ops they stay single graph
    nodes. The norms, rotary and activation run the pure-torch reference, which inductor fuses
    itself. Ops are swapped on the engine's op table instance (every layer holds the same one).

    variant "views": the cache write mutates the layer's k_cache / v_cache, views of the one KV
    pool, as the engine passes them. Sixty mutated graph inputs that alias one storage: AOTAutograd
    merges them into a synthetic base and the functionalized write (auto_functionalized) cannot be
    re-inplaced, so every layer's write clones the span of the pool its two views cover (about half
    of it) and copies it back. variant "pool": the write mutates the whole pool tensor (one graph
    input, no aliasing) at a layer index, and attention reads pool[0, i] / pool[1, i] views made
    inside the graph: inductor re-inplaces it, nothing is copied.
    """
    from vlinfer.layers import Attention
    from vlinfer.ops import reference
    ops = runner.ctx.ops
    ext = ops.ext

    @torch.library.custom_op("vlinfer_bench::store_kvcache", mutates_args=("k_cache", "v_cache"))
    def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        ext.store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    @store_kvcache.register_fake
    def _(key, value, k_cache, v_cache, slot_mapping):
        return None

    @torch.library.custom_op("vlinfer_bench::store_kvcache_pool", mutates_args=("kv_pool",))
    def store_kvcache_pool(key: torch.Tensor, value: torch.Tensor, kv_pool: torch.Tensor,
                           layer: int, slot_mapping: torch.Tensor) -> None:
        ext.store_kvcache(key, value, kv_pool[0, layer], kv_pool[1, layer], slot_mapping)

    @store_kvcache_pool.register_fake
    def _(key, value, kv_pool, layer, slot_mapping):
        return None

    @torch.library.custom_op("vlinfer_bench::decode_attention", mutates_args=())
    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
        return ext.paged_decode_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_lens,
                                          scale)

    @decode_attention.register_fake
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return torch.empty(q.shape, dtype=q.dtype)

    ops.store_kvcache = lambda k, v, kc, vc, slots: store_kvcache(k, v, kc, vc, slots)
    ops.paged_attention = lambda q, kc, vc, cu, lens, tables, scale: decode_attention(
        q, kc, vc, tables, lens, scale)
    for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "apply_rotary", "linear"):
        setattr(ops, op, getattr(reference, op))
    if variant == "pool":
        for i, layer in enumerate(runner.cache_pool.layers):
            assert layer.k_cache.data_ptr() == runner.cache_pool.kv_cache[0, i].data_ptr()
            layer.kv_pool, layer.layer_index = runner.cache_pool.kv_cache, i

        def forward(self, q, k, v):  # Attention.forward, with the write addressed as (pool, layer)
            step = self.ctx.forward_context()
            store_kvcache_pool(k, v, self.kv_pool, self.layer_index, step.slot_mapping)
            o = decode_attention(q, self.kv_pool[0, self.layer_index],
                                 self.kv_pool[1, self.layer_index], step.block_tables,
                                 step.seq_lens, self.scale)
            return o.flatten(1)

        Attention.forward = forward  # this child process only


def measure(args) -> None:
    """One mode in this process; prints 'RESULT first_call_s steady_step_ms checksum graphs'."""
    if args.mode == "compile":
        import torch._inductor.config as inductor_config
        from vlinfer.engine import model_runner as model_runner_module
        # inductor sees plain weights (freezing packs itself)
        model_runner_module.pack_weights = lambda model: None
        inductor_config.freezing = args.freezing
    from vlinfer import LLM
    from vlinfer.layers import ForwardContext
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_context + 8)
    runner = llm.engine.model_runner
    model = runner.model
    if args.mode == "compile":
        register_kernels_as_custom_ops(runner, args.variant)
        model = torch.compile(model, dynamic=False)
    rng = random.Random(args.seed)
    bs, b = runner.block_size, args.batch
    lens = [rng.randint(args.min_context, args.max_context) for _ in range(b)]
    width = -(-max(lens) // bs)
    blocks = list(range(runner.cache_pool.kv_cache.shape[2]))
    rng.shuffle(blocks)
    tables = torch.tensor([[blocks[(i * width + j) % len(blocks)] for j in range(width)]
                           for i in range(b)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    slots = torch.tensor(
        [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)])
    gen = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(100, 30000, (b,), generator=gen)
    positions = seq_lens.long() - 1
    pool = runner.cache_pool.kv_cache
    pool.copy_(torch.randn(pool.shape, generator=gen).to(pool.dtype))
    print(f"POOL {tuple(pool.shape)} {pool.numel() * pool.element_size() / 2 ** 20:.1f} MiB",
          flush=True)
    step_ctx = ForwardContext(slot_mapping=slots,
                              cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
                              seq_lens=seq_lens, block_tables=tables, decode_only=True)
    with torch.inference_mode():
        def step():
            with runner.ctx.stepping(step_ctx):
                return model(input_ids, positions)
        start = time.perf_counter()
        out = step()
        first = time.perf_counter() - start
        step()
        start = time.perf_counter()
        for _ in range(args.steps):
            out = step()
        ms = (time.perf_counter() - start) / args.steps * 1e3
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(args.steps):
                    step()
            print(
                prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total",
                                                                   row_limit=25), flush=True)
    # graphs compiled over all calls: 1 means no recompiles, no breaks
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"] if args.mode == "compile" else 0
    print(f"RESULT {first:.2f} {ms:.2f} {out.float().abs().mean().item():.6f} {graphs}", flush=True)


def main(argv=None):
    p = common.parser(__doc__)
    common.add_model_arg(p)
    common.add_dtype_arg(p, choices=common.DTYPES[:2])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min-context", type=int, default=100)
    p.add_argument("--max-context", type=int, default=300)
    p.add_argument("--steps", type=int, default=3,
                   help="timed steps after the first call and one warm-up")
    common.add_seed_arg(p)
    # one mode, in a child
    p.add_argument("--mode", choices=["eager", "compile"], help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=["views", "pool"], default="pool", help=argparse.SUPPRESS)
    p.add_argument("--freezing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true",
                   help="child only: print a torch.profiler table")
    p.add_argument(
        "--threads", type=int, default=None,
        help="OMP_NUM_THREADS for every child (1 on a shared, loaded machine: OpenMP barriers of "
             "2+ "
        "threads on oversubscribed cores cost ms each)")
    p.add_argument(
        "--log-dir", help="keep each child's stderr there (run with TORCH_LOGS=output_code to keep "
        "the generated code)")
    args = p.parse_args(argv)
    if args.mode:
        measure(args)
        return 0
    print(
        f"{args.model} {args.dtype}, decode step of batch {args.batch}, contexts "
        f"{args.min_context}-"
        f"{args.max_context}, {args.threads or torch.get_num_threads()} threads; {machine()}",
        flush=True)
    rows = []
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    # the views row copies about half the pool per layer: seconds per step
    slow_steps = ["--steps", "1"]
    for name, extra in [
        ("eager (our kernels, prepacked linears)", ["--mode", "eager"]),
        ("compile, cache write on per-layer pool views (old)",
         ["--mode", "compile", "--variant", "views"] + slow_steps),
        ("compile, cache write on the whole pool", ["--mode", "compile", "--variant", "pool"]),
        ("compile, whole pool, freezing", ["--mode", "compile", "--variant", "pool", "--freezing"])
    ]:
        cmd = [
            sys.executable, __file__, "--model", args.model, "--dtype", args.dtype, "--batch",
            str(args.batch), "--min-context",
            str(args.min_context), "--max-context",
            str(args.max_context), "--steps",
            str(args.steps), "--seed",
            str(args.seed)
        ] + extra
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            with open(os.path.join(args.log_dir, f"row{len(rows)}.log"), "w") as log:
                log.write(done.stdout + done.stderr)
        result = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
        if done.returncode != 0 or not result:
            rows.append((name, None, None, None, 0, (done.stderr.strip().splitlines() or
                                                     ["?"])[-1][:120]))
            continue
        first, step, checksum, graphs = (float(x) for x in result[0].split()[1:])
        rows.append((name, first, step, checksum, int(graphs), ""))
        print(f"  {name}: first call {first:.1f}s, step {step:.1f} ms", flush=True)
    eager_step = rows[0][2]
    cells = []
    for name, first, step, checksum, graphs, error in rows:
        if step is None:
            cells.append((name, f"failed: {error}", "", "", "", ""))
        else:
            ratio = f"{eager_step / step:.2f}x" if eager_step else "-"
            cells.append((name, f"{first:.1f}", f"{step:.1f}", ratio, graphs or
                          "-", f"{checksum:.5f}"))
    table([
        "decode step", "first call (s)", "steady step (ms)", "vs eager", "graphs compiled",
        "mean abs hidden"
    ], cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
