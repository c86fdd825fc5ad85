"""Captioning throughput on Ray: images/s with 1 and 2 engine replicas on this machine, the
single-process captioner beside them, and Ray Data's own cost per block (an identity stage over the
same blocks), so the scaling across machines can be estimated: one engine per device, each adding
its images/s minus the per-block overhead.

    python bench/caption_scale.py [--images 256] [--batch-size 16] [--model qwen3-vl-tiny]
    [--max-tokens 16]

Prints one table. On a 2-core machine, 2 replicas share the same cores (each gets one), so the
number to read is the per-block overhead and how close 2 replicas come to one process; on a cluster
each replica has its own device.
"""
import os
import sys
import tempfile
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import machine, table  # noqa: E402


def make_images(folder: str, n: int) -> list[str]:
    rng = np.random.RandomState(0)
    paths = []
    for i in range(n):
        path = os.path.join(folder, f"img_{i:05d}.png")
        Image.fromarray(rng.randint(0, 256, (96, 128, 3)).astype(np.uint8)).save(path)
        paths.append(path)
    return paths


class Identity:
    def __call__(self, batch):
        return batch


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    common.add_model_arg(p, "qwen3-vl-tiny")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-pixels", type=int, default=128 * 96)
    args = p.parse_args()
    import ray
    from vlinfer import LLM, SamplingParams
    from vlinfer.captioning import caption_files
    from vlinfer.integrations.ray_caption import caption_on_ray
    engine = dict(max_model_len=512, kv_cache_bytes=64 * 2 ** 20)
    sampling = dict(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_images(tmp, args.images)
        with LLM(args.model, **engine) as llm:
            caption_files(llm, paths[:args.batch_size], os.path.join(tmp, "warm.jsonl"),
                          batch_size=args.batch_size, sampling_params=SamplingParams(**sampling),
                          max_pixels=args.max_pixels, progress=False)
            start = time.perf_counter()
            s = caption_files(llm, paths, os.path.join(tmp,
                                                       "one.jsonl"), batch_size=args.batch_size,
                              sampling_params=SamplingParams(**sampling),
                              max_pixels=args.max_pixels, progress=False)
            rows.append(("single process", s.captioned / (time.perf_counter() - start), s.tokens))
        ray.init(include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        cores = int(ray.cluster_resources().get("CPU", 1))
        for replicas in (1, 2):
            # Each job starts its actors and engines: run half the images, then all of them, and
            # take the steady rate from the difference, so start-up (shown apart) does not count as
            # captioning time.
            seconds = {}
            for n in (len(paths) // 2, len(paths)):
                out = os.path.join(tmp, f"ray{replicas}-{n}.jsonl")
                s = caption_on_ray(paths[:n], out, model=args.model, engine_options=engine,
                                   batch_size=args.batch_size, sampling=sampling,
                                   max_pixels=args.max_pixels, replicas=replicas,
                                   cpus_per_replica=max(1, cores // replicas), progress=False)
                seconds[n] = s.seconds
            (n1, t1), (n2, t2) = sorted(seconds.items())
            rate = (n2 - n1) / (t2 - t1)
            rows.append((f"ray, {replicas} replica(s) (steady; start-up {t2 - n2 / rate:.1f} s)",
                         rate, s.tokens))
        # Per block, start-up excluded: the same identity job over few and over many blocks, the
        # difference.
        times = {}
        for blocks in (8, 520):
            ds = ray.data.from_items([{"path": str(i)} for i in range(blocks * args.batch_size)],
                                     override_num_blocks=blocks)
            start = time.perf_counter()
            for _ in ds.map_batches(Identity, batch_size=args.batch_size, concurrency=2,
                                    num_cpus=1).iter_batches(batch_size=None):
                pass
            times[blocks] = time.perf_counter() - start
        (b1, t1), (b2, t2) = sorted(times.items())
        per_block = (t2 - t1) / (b2 - b1)
        ray.shutdown()
    base = rows[0][1]
    print(f"\ncaptioning {args.images} images ({args.model}, {args.max_tokens} tokens each, batch "
          f"{args.batch_size}) on {machine()}")
    table(["run", "images/s", "tokens", "vs single process"],
          [(name, f"{rate:.2f}", tokens, f"{rate / base:.2f}x") for name, rate, tokens in rows],
          right=True)
    print(
        f"\nRay Data per-block overhead (identity stage, 2 actors, blocks of {args.batch_size} "
        "rows, actor "
        f"start-up excluded: {b1} vs {b2} blocks): {per_block * 1e3:.1f} ms per block")


if __name__ == "__main__":
    main()
