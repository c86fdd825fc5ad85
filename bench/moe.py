"""Mixture-of-experts throughput: vlinfer vs transformers `generate` (its default experts
implementation), side by side in one run on the same random-weight Qwen3-MoE checkpoint and the same
token ids.

The checkpoint has Qwen3-30B-A3B's layer shapes (hub config.json: hidden 2048, 32 query / 4 KV heads
of 128, 128 experts, top-8, moe_intermediate 768, norm_topk_prob, every layer MoE, vocab 151936,
rope theta 1e6) at reduced depth (4 layers by default), random weights (transformers' init), built
once and cached. bf16 where the CPU has native bf16 (AVX512-BF16 or AMX), float32 otherwise
(cpu_features.cpu_has_native).

Two workloads, each on both engines:
- offline batch: seeded random prompt token ids and output lengths, greedy, EOS ignored
  (transformers: left-padded
  batches, each generating its longest output; only requested tokens count). Reported with its share
  of this
  machine's matmul peak (MFU), measured in this run as bench/throughput.py does.
- single-stream decode: one prompt, then `--decode-tokens` greedy tokens; time per token = (time for
  n tokens - time
  for 1) / (n - 1), so the prefill is not counted. Reported with its share of this machine's memory
  bandwidth
  (measured in this run: the best of a few sums over a 1 GiB buffer), counting the bytes one decode
  step must read:
  every non-expert weight, the LM head, and the experts actually used (top_k distinct experts per
  layer for one
  token: 3 x hidden x moe_intermediate weights each).

The batch is bound by memory, not by the matmul peak: each decode step reads every expert that some
running sequence routes to (~111 of 128 per layer at 32 sequences). The script prints that floor
(the decode steps' weight bytes over the measured bandwidth) beside both engines' times, and what
share of 3x transformers' time it takes.

Model FLOPs (the same for both engines): per forwarded token and layer 2 x (attention projections +
router + top_k experts x 3 x H x I), plus causal attention (4 x q_dim per attended position), plus 2
x the LM head per sampled token.

    python bench/moe.py                                        # 30B-A3B shapes, 4 layers, both
    engines
    python bench/moe.py --shape tiny --num-requests 4 --min-output 4 --max-output 8 --decode-tokens
    4  # quick check
"""
import gc
import os
import random
import sys
import time

import torch

# `vlinfer bench` loads this file by its path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import (CPU_PEAK_PROBE, bandwidth_gbs, machine, matmul_peak_gflops,  # noqa: E402
                    progress, table)


def qwen3_moe_config(shape: str, layers: int):
    """Qwen3-30B-A3B's published values (layers reduced), or a tiny one for a quick check."""
    from transformers import Qwen3MoeConfig
    common = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu",
                  rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  vocab_size=151936, max_position_embeddings=40960, bos_token_id=151643,
                  eos_token_id=151645,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if shape == "tiny":
        return Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96,
                              **common)
    return Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                          **common)


def ensure_checkpoint(folder: str, shape: str, layers: int, dtype: torch.dtype, seed: int) -> str:
    """The random checkpoint (safetensors in the per-expert hub layout that save_pretrained writes),
    built once."""
    config = qwen3_moe_config(shape, layers)
    name = f"qwen3-moe-{shape}-{config.num_hidden_layers}l-{str(dtype).split('.')[-1]}"
    return common.random_checkpoint(os.path.join(folder, name), name, "Qwen3MoeForCausalLM",
                                    lambda: config, dtype, seed)


def dims(config) -> dict:
    h, layers = config.hidden_size, config.num_hidden_layers
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    expert = 3 * h * config.moe_intermediate_size
    attention = h * (2 * q_dim + 2 * kv_dim)  # q, k, v, o
    return dict(
        layers=layers,
        q_dim=q_dim,
        top_k=config.num_experts_per_tok,
        expert=expert,
        active_layer=attention + h * config.num_experts + config.num_experts_per_tok * expert,
        # what every token reads but the experts
        dense_layer=attention + h * config.num_experts + 2 * h,
        head=h * config.vocab_size)


def model_flops(d: dict, prompt_lens, out_lens) -> float:
    total = 0.0
    for p, n in zip(prompt_lens, out_lens):
        forwarded = p + n - 1
        attended = forwarded * (forwarded + 1) // 2
        total += 2 * d["layers"] * d["active_layer"] * forwarded + 2 * d["head"] * n
        total += 4 * d["layers"] * d["q_dim"] * attended
    return total


def decode_step_bytes(d: dict, element: int) -> float:
    """Weights one decode step of one sequence reads: non-expert layer weights, top_k experts per
    layer, LM head."""
    return element * (d["layers"] * (d["dense_layer"] + d["top_k"] * d["expert"]) + d["head"])


def batch_decode_bytes(d: dict, config, out_lens, element: int) -> float:
    """Weights the batch's decode steps must read, however fast the kernels: per step the non-expert
    weights, the LM head and every expert that some running sequence routes to (the expected number
    of distinct experts among n sequences x top_k picks under uniform routing, which random weights
    come close to)."""
    total = 0.0
    experts, k = config.num_experts, config.num_experts_per_tok
    for step in range(1, max(out_lens) + 1):
        running = sum(n >= step for n in out_lens)
        distinct = experts * (1 - (1 - k / experts) ** running)
        total += d["layers"] * (d["dense_layer"] + distinct * d["expert"]) + d["head"]
    return element * total


def single_prompt(args):
    rng = random.Random(args.seed + 1)
    return common.token_ids(rng, args.decode_prompt)


class Vlinfer:
    name = "vlinfer"

    def __init__(self, path, dtype, max_len):
        from vlinfer import LLM
        self.llm = LLM(path, dtype=dtype, max_model_len=max_len)
        self.generate = common.greedy(self.llm)
        self.generate([[1, 2, 3]], [4])  # warm-up


class Transformers:
    name = "transformers"

    def __init__(self, path, dtype, batch_size):
        from transformers import AutoModelForCausalLM
        # default experts impl.
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.batch_size = batch_size
        self.generate([[1, 2, 3]], [4])

    def generate(self, prompts, out_lens):
        return common.left_padded_generate(self.model, prompts, out_lens, self.batch_size)

    def implementation(self) -> str:
        return getattr(self.model.config, "_experts_implementation", None) or "default"


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def measure(engine, prompts, out_lens, stream_prompt, decode_tokens):
    batch_s, outputs = timed(engine.generate, prompts, out_lens)
    one_s, _ = timed(engine.generate, [stream_prompt], [1])
    many_s, _ = timed(engine.generate, [stream_prompt], [decode_tokens])
    return dict(batch_s=batch_s, outputs=outputs,
                per_token_s=max(many_s - one_s, 1e-9) / (decode_tokens - 1))


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--shape", default="30b-a3b", choices=["30b-a3b", "tiny"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bf16 where the CPU has native bf16, float32 otherwise")
    common.add_text_workload_args(p, num_requests=32, max_output=128)
    p.add_argument("--decode-prompt", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=32)
    common.add_transformers_args(p, batch_size=32)
    p.add_argument("--folder", default="~/.cache/vlinfer/bench")
    args = p.parse_args(argv)
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the first token is the prefill's)")
    from vlinfer.platform import cpu_features
    if args.dtype == "auto":
        dtype = torch.bfloat16 if cpu_features.cpu_has_native(torch.bfloat16) else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    path = ensure_checkpoint(args.folder, args.shape, args.layers, dtype, args.seed)
    config = qwen3_moe_config(args.shape, args.layers)
    d = dims(config)
    prompts, out_lens = common.text_workload(args)
    stream_prompt = single_prompt(args)
    flops = model_flops(d, list(map(len, prompts)), out_lens)
    dtype_name = str(dtype).split(".")[-1]
    print(f"machine: {machine()}")
    print(
        f"model: random Qwen3-MoE, {args.shape} shapes, {config.num_hidden_layers} layers, "
        f"{config.num_experts} "
        f"experts top-{config.num_experts_per_tok}, hidden {config.hidden_size}, moe_intermediate "
        f"{config.moe_intermediate_size}, {dtype_name}")
    print(
        f"batch: {args.num_requests} requests, prompts {args.min_input}-{args.max_input} "
        f"({sum(map(len, prompts))} tokens), outputs {args.min_output}-{args.max_output} "
        f"({sum(out_lens)} tokens), "
        f"greedy, EOS ignored; {flops / 1e12:.2f} TFLOP of model FLOPs")
    print(f"single stream: a {args.decode_prompt}-token prompt, {args.decode_tokens} decode tokens",
          flush=True)
    peak_before, bw_before = matmul_peak_gflops(dtype, "cpu"), bandwidth_gbs()[0]
    max_len = max(args.max_input + args.max_output, args.decode_prompt + args.decode_tokens) + 8

    rows = []
    engine = Vlinfer(path, dtype, max_len)
    rows.append((engine.name, measure(engine, prompts, out_lens, stream_prompt,
                                      args.decode_tokens)))
    progress("vlinfer done")
    del engine
    gc.collect()
    if not args.skip_transformers:
        engine = Transformers(path, dtype, args.hf_batch_size)
        name = (f"transformers generate (batch {args.hf_batch_size}, "
                f"experts: {engine.implementation()})")
        rows.append((name, measure(engine, prompts, out_lens, stream_prompt, args.decode_tokens)))
        progress("transformers done")
        del engine
        gc.collect()
    peak = max(peak_before, matmul_peak_gflops(dtype, "cpu"))
    bandwidth = max(bw_before, bandwidth_gbs()[0])
    element = torch.tensor([], dtype=dtype).element_size()
    step_bytes = decode_step_bytes(d, element)

    print(f"\nmachine: {machine()}")
    table([
        "engine", "batch output tok/s", f"batch MFU ({dtype_name})", "single-stream ms/token",
        "single-stream tok/s", "share of memory bandwidth"
    ], [(name, f"{sum(out_lens) / r['batch_s']:.1f}", f"{flops / r['batch_s'] / peak / 1e9:.1%}",
         f"{r['per_token_s'] * 1e3:.1f}", f"{1 / r['per_token_s']:.1f}",
         f"{step_bytes / r['per_token_s'] / bandwidth / 1e9:.1%}") for name, r in rows])
    print(
        f"\nMFU: model FLOPs / time / this machine's {dtype_name} matmul peak {peak:.0f} GFLOP/s "
        f"({CPU_PEAK_PROBE}, before and after the engines). Bandwidth: {step_bytes / 1e9:.3f} GB "
        "of weights per "
        f"decode step (non-expert weights, LM head, {d['top_k']} experts per layer) / time per "
        "token / "
        f"{bandwidth:.1f} GB/s (best 1 GiB sum).")
    floor_bytes = batch_decode_bytes(d, config, out_lens, element)
    floor_s = floor_bytes / bandwidth / 1e9
    print(
        f"Batch floor: its {max(out_lens)} decode steps read {floor_bytes / 1e9:.1f} GB of weights "
        "(every expert a "
        f"running sequence routes to, each step), {floor_s:.1f} s at {bandwidth:.1f} GB/s before "
        "any prefill; "
        + ", ".join(f"{name.split(' ')[0]} {r['batch_s']:.1f} s" for name, r in rows) + ".")
    if len(rows) > 1:
        (_, ours), (name, theirs) = rows
        print(
            f"3x transformers is {theirs['batch_s'] / 3:.1f} s for the whole batch: "
            f"{floor_s / (theirs['batch_s'] / 3):.0%} of it is the decode steps' weight reads at "
            "full bandwidth."
        )
        print(f"vlinfer / {name}: batch {theirs['batch_s'] / ours['batch_s']:.2f}x, single stream "
              f"{theirs['per_token_s'] / ours['per_token_s']:.2f}x (target: >= 3x on the batch)")
        same = sum(a == b for a, b in zip(ours["outputs"], theirs["outputs"]))
        print(
            f"greedy outputs identical for {same}/{len(prompts)} requests ({dtype_name}: near-tied "
            "logits of "
            "random weights diverge)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
