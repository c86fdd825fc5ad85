"""MTP speculation's acceptance and single-stream speed on a tiny Qwen3.5 whose MTP head is trained
here: random weights give no acceptance to measure, so a random-weight Qwen3.5 text model (the
target, frozen) generates greedy continuations of random prompts, and its `mtp.*` head (the
published layout, vlinfer/toy/mtp_heads.py) is trained for --steps steps to predict, at each
position, the token two on. Then vlinfer runs held-out prompts one at a time, greedy, without
speculation and with method "mtp" (k = --num-speculative-tokens, adaptive off), and reports the
acceptance (accepted / proposed tokens), the mean accepted length (tokens per verification) and
decode tok/s of each; "tokens" says whether the two engines' outputs are equal.

    python bench/mtp_acceptance.py
    python bench/mtp_acceptance.py --hidden 512 --layers 8 --steps 1500 --new-tokens 128
"""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import machine, progress, table  # noqa: E402


def build(args, folder: str):
    """The target (saved with its trained head) and the held-out prompts."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from vlinfer.toy.mtp_heads import TorchMTP, save_mtp, train_mtp
    from vlinfer.toy.tiny_checkpoints import _rescale, qwen_tokenizer_files
    torch.manual_seed(args.seed)
    heads = max(1, args.hidden // 64)
    config = Qwen3_5TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(args.layers)],
        num_attention_heads=heads, num_key_value_heads=1, head_dim=64, linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Qwen3_5ForCausalLM"])
    model = Qwen3_5ForCausalLM(config).eval()
    _rescale(model, torch.Generator().manual_seed(args.seed))
    rng = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=rng).tolist()
               for _ in range(args.train_prompts + args.eval_prompts)]
    head = TorchMTP(model)
    start = time.perf_counter()
    train_mtp(model, head, prompts[:args.train_prompts], args.new_tokens, args.steps,
              log=progress)
    progress(f"head trained: {args.steps} steps in {time.perf_counter() - start:.0f}s")
    model.save_pretrained(folder, safe_serialization=True)
    for name in os.listdir(qwen_tokenizer_files()):
        path = os.path.join(qwen_tokenizer_files(), name)
        if os.path.isfile(path):
            with open(path, "rb") as src, open(os.path.join(folder, name), "wb") as dst:
                dst.write(src.read())
    save_mtp(folder, head)
    return prompts[args.train_prompts:]


def run(folder: str, prompts, args, spec):
    """(outputs, decode tok/s, speculator) of one engine, one request at a time."""
    from vlinfer import LLM, SamplingParams
    llm = LLM(folder, dtype=args.dtype, max_model_len=1024, enable_prefix_caching=False,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    warm = llm.engine.speculator
    before = (warm.num_draft_tokens, warm.num_accepted_tokens, warm.num_drafts)
    outputs, seconds = [], 0.0
    one = SamplingParams(temperature=0, max_tokens=1)
    for ids in prompts:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)  # the prompt alone
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - start - prefill
        outputs.append(out.outputs[0].token_ids)
    s = llm.engine.speculator
    counts = (s.num_draft_tokens - before[0], s.num_accepted_tokens - before[1],
              s.num_drafts - before[2])
    rate = len(prompts) * (args.new_tokens - 1) / seconds
    return outputs, rate, counts


def main():
    p = common.parser(__doc__)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--train-prompts", type=int, default=48)
    p.add_argument("--eval-prompts", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=common.DTYPES)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as folder:
        prompts = build(args, folder)
        plain, plain_rate, _ = run(folder, prompts, args, None)
        progress(f"no speculation: {plain_rate:.1f} tok/s")
        spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens,
                "adaptive": False}
        mtp, mtp_rate, (proposed, accepted, drafts) = run(folder, prompts, args, spec)
        progress(f"mtp: {mtp_rate:.1f} tok/s")
    acceptance = accepted / max(proposed, 1)
    table(["engine", "decode tok/s", "speed-up", "acceptance", "tokens per verification",
           "tokens"],
          [["no speculation", f"{plain_rate:.1f}", "1.00x", "-", "-", "-"],
           [f"mtp, k={args.num_speculative_tokens}", f"{mtp_rate:.1f}",
            f"{mtp_rate / plain_rate:.2f}x", f"{acceptance:.0%} ({accepted}/{proposed})",
            f"{(accepted + drafts) / max(drafts, 1):.2f}",
            "equal" if mtp == plain else "DIFFER"]])


if __name__ == "__main__":
    main()
