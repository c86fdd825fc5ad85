"""The text batch workload the throughput benchmarks share: seeded random prompts and output lengths, given on the
command line as ranges."""
import random


def add_args(p, num_requests: int, max_output: int) -> None:
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=max_output)
    p.add_argument("--seed", type=int, default=0)


def make(args) -> tuple[list[list[int]], list[int]]:
    """(prompts as token ids, output length of each): the same for every engine of a run and every run of a seed."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_requests)]
    outputs = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_requests)]
    return prompts, outputs
