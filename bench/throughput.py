"""Offline throughput, vlinfer vs transformers `generate`, side by side in one process on the same weights.

The workload is nano-vllm's benchmark scaled to a 2-core CPU: seeded random prompt token ids and output
lengths, EOS ignored. transformers runs left-padded batches; each batch generates its longest requested output,
and only requested tokens count, for both engines.

    python bench/throughput.py                      # 64 requests, prompts and outputs 32-256, bf16, SmolLM2-135M
    python bench/throughput.py --num-requests 16 --skip-transformers
"""
import argparse
import random
import sys
import time

import torch


def make_workload(args):
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_requests)]
    outputs = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_requests)]
    return prompts, outputs


def run_vlinfer(args, prompts, out_lens):
    from vlinfer import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_input + args.max_output + 8,
              enforce_eager=args.enforce_eager)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    del llm
    return produced, elapsed


def run_transformers(args, prompts, out_lens):
    from transformers import AutoModelForCausalLM
    from vlinfer import model_loader
    source = model_loader.resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    if source.gguf_file:
        # transformers keeps GGUF weights packed and computes through float32 dequant kernels; give it the same
        # dequantized weights vlinfer runs, as a plain model in the benchmark dtype.
        config = model_loader.load_config(source)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        state = dict(model_loader.iterate_weights(source, config))
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    model.eval()
    pad = 0
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=pad)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        batch, lens = prompts[i:i + args.hf_batch_size], out_lens[i:i + args.hf_batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=True, temperature=0.6, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    return sum(out_lens), elapsed


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args(argv)
    prompts, out_lens = make_workload(args)
    print(f"workload: {args.num_requests} requests, prompts {args.min_input}-{args.max_input} "
          f"({sum(map(len, prompts))} tokens), outputs {args.min_output}-{args.max_output} ({sum(out_lens)} tokens), "
          f"{args.model} {args.dtype}, torch threads {torch.get_num_threads()}", flush=True)
    rows = [("vlinfer", *run_vlinfer(args, prompts, out_lens))]
    print(f"vlinfer done: {rows[0][1] / rows[0][2]:.1f} tok/s", flush=True)
    if not args.skip_transformers:
        rows.append((f"transformers generate (batch {args.hf_batch_size})", *run_transformers(args, prompts, out_lens)))
    print(f"\n| engine | output tokens | time (s) | output tok/s |\n|---|---|---|---|")
    for name, tokens, seconds in rows:
        print(f"| {name} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} |")
    if len(rows) == 2:
        ratio = (rows[0][1] / rows[0][2]) / (rows[1][1] / rows[1][2])
        print(f"\nvlinfer / transformers throughput ratio: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
