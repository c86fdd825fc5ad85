"""Speculative decoding on the real SmolLM2-135M-Instruct (its Q4_1 GGUF, blocks kept), greedy,
single stream and a
batch of 8, on two workloads of 8 chat requests each:
- copy-heavy: answers that quote the prompt (fix the typos, a list to JSON, a code edit, extraction
  to JSON,
  transcription, rewriting, a list extended);
- free generation: open questions.

Runs, side by side in one run: vlinfer without speculation; vlinfer with n-gram proposals (prompt
lookup); vlinfer with a draft model (a random-weight 2-layer model of SmolLM2's vocabulary, the only
draft this machine has: its row gives the cost of drafting and its exactness, not a speed-up);
llama.cpp on the same GGUF without and with its own prompt-lookup decoding (llama-cpp-python's
LlamaPromptLookupDecoding), one request at a time (its peer's only mode: the "batch" rows run the 8
requests one after another there).

Every engine generates the same tokens per request: as many as vlinfer's greedy answer without
speculation has (EOS respected there, at most --max-tokens), then EOS ignored everywhere. Decode
tok/s = (tokens - 1 per request) / (whole requests - prompts alone), best of --repeat x --rounds
(vlinfer's engines take turns each round, so a slow spell of the machine hits them alike), with
prefix caching off (llama.cpp's peer resets its cache per prompt too). "tokens" says whether the
outputs equal vlinfer's without speculation. The memory-bandwidth share is decode tok/s x GGUF bytes
(what one plain decode step reads) / the read bandwidth measured in the same run: above 100% is more
tokens than plain decoding could read the weights for.

    python bench/speculative.py
    python bench/speculative.py --num-speculative-tokens 5 --repeat 3
    python bench/speculative.py --workloads free --shapes batch --rounds 4
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import peers  # noqa: E402
from common import bandwidth_gbs, machine, progress, table  # noqa: E402
from peers.protocol import time_runs  # noqa: E402

COPY = [
    "Fix the typos in this paragraph and return only the corrected paragraph:\n\nThe quick brown "
    "fox jumpd over the "
    "lazy dog. It was a sunny day and the fox was verry happy. He ran thrugh the forest and found "
    "a small river where "
    "he drank some cold water before going home.",
    "Convert this list to JSON, an array of objects with the keys name and age:\n- Alice, 31\n- "
    "Bob, 27\n- Carol, 45"
    "\n- Dave, 38\n- Eve, 22",
    "Rename the variable x to total in this function and return the whole function:\n\ndef "
    "add_all(values):\n    "
    "x = 0\n    for v in values:\n        x = x + v\n    return x\n",
    "Extract the name, the city and the phone number from this text as JSON: My name is John "
    "Smith, I live in Boston, "
    "Massachusetts, and you can call me at 555-1234 any day after five.",
    "Repeat this sentence exactly: The committee will meet on the third Thursday of every month in "
    "the main hall of "
    "the public library.",
    "Rewrite this note with Monday replaced by Tuesday and nothing else changed: Hi team, the "
    "review is on Monday at "
    "ten. Please bring your reports and the slides from last week. Thanks, Anna.",
    "Here is my shopping list: eggs, milk, bread, apples, cheese, rice, tomatoes. Add butter at "
    "the end and write "
    "the whole list again, one item per line.",
    "Correct the grammar of this text and return it: She go to the market every days and buy some "
    "vegetable for "
    "her family, then she cook a big dinner for everyone.",
]
FREE = [
    "Write a short story about a robot who learns to paint.", "Explain why the sky is blue.",
    "Give me three ideas for a birthday party.", "What are the benefits of regular exercise?",
    "Describe a day at the beach.", "Write a poem about autumn leaves.",
    "How do I make a good cup of tea?", "Tell me about the history of the bicycle."
]


def chat_ids(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def runs(prompts, lengths, repeat, batch: bool):
    """The prompts alone (one token each) and the whole requests: all at once (batch) or one after
    another."""
    groups = [list(range(len(prompts)))] if batch else [[i] for i in range(len(prompts))]
    out = []
    for g, group in enumerate(groups):
        out.append(
            dict(name=f"prompt{g}", prompts=[prompts[i] for i in group],
                 max_tokens=[1] * len(group), repeat=repeat))
        out.append(
            dict(name=f"whole{g}", prompts=[prompts[i] for i in group],
                 max_tokens=[lengths[i] for i in group], repeat=repeat))
    return out


def decode(results: dict, lengths: list[int]) -> tuple[float, list[list[int]]]:
    """Decode tok/s over every group, and the outputs in request order."""
    seconds = sum(min(results[f"whole{g}"]["seconds"]) - min(results[f"prompt{g}"]["seconds"])
                  for g in range(len(results) // 2))
    outputs = [o for g in range(len(results) // 2) for o in results[f"whole{g}"]["outputs"]]
    return (sum(lengths) - len(lengths)) / seconds, outputs


def draft_checkpoint(vocab: int) -> str:
    import torch
    from transformers import LlamaConfig
    folder = os.path.join(peers.cache_dir(), f"random-draft-2l-v{vocab}")
    return common.random_checkpoint(
        folder, "draft", "LlamaForCausalLM",
        lambda: LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=2048, tie_word_embeddings=True), torch.float32,
        seed=0)


def main():
    p = common.parser(__doc__)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2,
                   help="vlinfer's engines run in turn this many times; best kept")
    p.add_argument("--workloads", nargs="+", choices=["copy-heavy", "free"],
                   default=["copy-heavy", "free"])
    p.add_argument("--shapes", nargs="+", choices=["single", "batch"], default=["single", "batch"],
                   help="single stream, a batch of 8, or both")
    common.add_skip_args(p, "llama.cpp")
    args = p.parse_args()
    import torch
    from vlinfer import LLM, SamplingParams, loading
    print(machine(), flush=True)
    source = loading.resolve_model("smollm2")
    gguf = os.path.join(source.folder, source.gguf_file)
    gguf_bytes = os.path.getsize(gguf)
    k = args.num_speculative_tokens
    ngram = {
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max
    }
    options = dict(max_model_len=2048, enable_prefix_caching=False)
    base = LLM("smollm2", **options)
    tokenizer = base.get_tokenizer()
    draft = {
        "model": draft_checkpoint(base.engine.text_config.vocab_size), "num_speculative_tokens": k
    }
    workloads = {
        name: [chat_ids(tokenizer, t) for t in texts]
        for name, texts in (("copy-heavy", COPY), ("free", FREE)) if name in args.workloads
    }
    lengths = {}
    # each request's length: vlinfer's own answer, EOS respected
    for name, prompts in workloads.items():
        outs = base.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0, max_tokens=args.max_tokens),
                             use_tqdm=False)
        lengths[name] = [max(16, len(o.outputs[0].token_ids)) for o in outs]
    bandwidth_before = bandwidth_gbs()[0]
    engines = {
        "vlinfer": base, "vlinfer n-gram": LLM("smollm2", speculative_config=ngram, **options),
        "vlinfer draft (random)": LLM("smollm2", speculative_config=draft, **options)
    }
    rows, reference = [], {}
    for workload, prompts in workloads.items():
        for batch in [shape == "batch" for shape in args.shapes]:
            shape = "batch of 8" if batch else "single stream"
            plan = runs(prompts, lengths[workload], args.repeat, batch)
            base_rate = None
            timed = {name: None for name in engines}
            counts = {name: [0, 0] for name in engines}
            # engines in turn, each round: a slow spell hits them alike
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    spec = llm.engine.speculator
                    before = (spec.num_draft_tokens, spec.num_accepted_tokens)
                    got = time_runs(common.greedy(llm), plan, tag=f"{name} {workload} {shape}: ")
                    timed[name] = got if timed[name] is None else \
                        {run: {**got[run],
                               "seconds": timed[name][run]["seconds"] + got[run]["seconds"]}
                         for run in got}
                    counts[name][0] += spec.num_draft_tokens - before[0]
                    counts[name][1] += spec.num_accepted_tokens - before[1]
            for name in engines:
                rate, outs = decode(timed[name], lengths[workload])
                reference.setdefault((workload, batch), outs)
                proposed, accepted = counts[name]
                base_rate = base_rate or rate
                rows.append([workload, shape, name, f"{rate:.1f}", f"{rate / base_rate:.2f}x",
                             f"{accepted / proposed:.0%} of {proposed}" if proposed else "-",
                             "same" if outs == reference[(workload, batch)] else "DIFFER", rate])
                progress(f"{name} {workload} {shape}: {rate:.1f} tok/s")
            for lookup in ((None, {"num_pred_tokens": k, "max_ngram_size": args.prompt_lookup_max})
                           if not args.skip_llamacpp and peers.usable("llama.cpp", "smollm2") else
                           ()):
                label = "llama.cpp" + (" prompt lookup" if lookup else "") + (" (one at a time)"
                                                                              if batch else "")
                request = {
                    "model": gguf, "threads": torch.get_num_threads(), "n_ctx": 2048, "runs": plan
                }
                if lookup:
                    request["prompt_lookup"] = lookup
                got = peers.try_run("llama.cpp", request)
                if got is None:
                    continue
                rate, outs = decode(got["runs"], lengths[workload])
                rows.append([workload, shape, label, f"{rate:.1f}", f"{rate / base_rate:.2f}x", "-",
                             "same" if outs == reference[(workload, batch)] else "differ", rate])
                progress(f"{label} {workload} {shape}: {rate:.1f} tok/s")
    bandwidth = max(bandwidth_before, bandwidth_gbs()[0])
    limit = bandwidth * 1e9 / gguf_bytes
    print(
        f"\nmemory read bandwidth {bandwidth:.1f} GB/s; one plain decode step reads the GGUF's "
        f"{gguf_bytes / 1e6:.0f} MB: {limit:.0f} tok/s is plain decoding's limit for one sequence\n"
    )
    table([
        "workload", "shape", "engine", "decode tok/s", "vs vlinfer", "accepted", "tokens",
        "of bandwidth limit"
    ], [r[:-1] + [f"{r[-1] / limit:.0%}"] for r in rows], right=True)
    rate = {(r[0], r[1], r[2].removesuffix(" (one at a time)")): r[-1] for r in rows}
    print()
    for workload in workloads:
        for shape in ("single stream", "batch of 8"):
            if (workload, shape, "vlinfer") not in rate:
                continue
            ngram_rate, lookup = rate[(workload, shape, "vlinfer n-gram")], rate.get(
                (workload, shape, "llama.cpp prompt lookup"))
            print(
                f"{workload}, {shape}: n-gram "
                f"{ngram_rate / rate[(workload, shape, 'vlinfer')]:.2f}x vlinfer without "
                "speculation" +
                (f", {ngram_rate / lookup:.2f}x llama.cpp prompt lookup" if lookup else ""))


if __name__ == "__main__":
    main()
