"""LoRA throughput (issue 38): one batch of requests spread over several PEFT adapters, side by side
in one run with the base model alone (the ceiling), vLLM's CPU backend with the same adapters and
transformers + PEFT running one adapter at a time, on the same weights and token ids, each with its
share of this machine's matmul peak.

The workload is bench/throughput.py's (seeded random prompt token ids and output lengths, greedy,
EOS ignored, SmolLM2-135M dequantized to a float32 safetensors folder once in vlinfer's cache
folder); request i runs adapter i mod --adapters. The adapters are made by PEFT itself and written
once to the cache folder: rank --rank, alpha 2 x rank, on every linear of the language model
(q/k/v/o and gate/up/down projections), A as PEFT initializes it, B seeded random (std 0.05: the
adapters change the greedy outputs without wrecking them).

    vlinfer, base model       LLM(model) on the prompts alone, no adapters: the ceiling
    vlinfer, LoRA             LLM(model, enable_lora=True, max_loras=--adapters,
    max_lora_rank=--rank), the whole
                              batch in one generate, each request with its LoRARequest
    vLLM-CPU, LoRA            the same through vLLM's CPU backend in its own venv (`make peers`;
    bench/peers): its
                              LLM(enable_lora=True, ...) with vLLM's LoRARequest per request. It
                              supports LoRA on
                              the CPU (torch punica ops) but turns its torch.compile off when LoRA
                              is on.
    transformers + PEFT       PeftModel with every adapter loaded; set_adapter, then that adapter's
    requests in
                              left-padded batches of --hf-batch-size, one adapter after the other

Every engine warms up before its timing (vlinfer and vLLM once per adapter, so the adapters are read
before the clock starts); start-ups are not timed. Share of the matmul peak = model FLOPs / wall
time / the dtype's matmul peak measured in this run (common.matmul_peak_gflops, before and after the
engines; the higher is used). Model FLOPs are bench/throughput.py's (2 x linear parameters per
forwarded token, the LM head per output token, causal attention), plus, on the LoRA rows, each
adapter's shrink and expand: 2 x rank x (in + out) per adapted linear per forwarded token. Accuracy:
the greedy outputs of vlinfer under each adapter against transformers + PEFT's for the same requests
(float32 is where they should agree token for token; bf16 near-tied logits diverge).

    python bench/lora.py                                  # 64 requests over 4 adapters of rank 16,
    bf16
    python bench/lora.py --dtype float32                  # the accuracy line token for token
    python bench/lora.py --num-requests 4 --max-tokens 4 --skip-vllm   # a quick check
"""
import os
import shutil
import sys
import time

import torch

# `vlinfer bench` loads this file by its path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import peers  # noqa: E402
from common import (CPU_PEAK_PROBE, machine, matmul_peak_gflops, model_dims, progress,  # noqa: E402
                    table)
from throughput import agreement, model_flops  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_STD = 0.05


def lora_flops(dims: dict, rank: int, prompt_lens, out_lens) -> float:
    """The adapters' own FLOPs: shrink (in -> rank) and expand (rank -> out) of every adapted
    linear, for every forwarded token (p + n - 1 per request)."""
    h, q, kv, inter = dims["hidden"], dims["q_dim"], dims["kv_dim"], dims["intermediate"]
    # q, k, v, o, gate, up, down
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)
    forwarded = sum(p + n - 1 for p, n in zip(prompt_lens, out_lens))
    return 2 * rank * per_layer * dims["layers"] * forwarded


def make_adapters(args) -> list[tuple[str, str]]:
    """[(name, PEFT folder)] for --adapters adapters of --rank on the model's dense weights, each
    built once into vlinfer's cache folder (a temporary folder renamed when complete)."""
    from peft import LoraConfig, get_peft_model
    stem = os.path.basename(peers.hf_folder(args.model)).removesuffix("-hf")
    adapters, base = [], None
    for i in range(args.adapters):
        name = f"adapter{i}"
        folder = os.path.join(peers.cache_dir(), f"{stem}-lora-r{args.rank}-{i}")
        adapters.append((name, folder))
        if os.path.exists(os.path.join(folder, "adapter_config.json")):
            continue
        if base is None:
            base = peers.dense_model(args.model, "float32").eval()
        start = time.perf_counter()
        torch.manual_seed(1000 + i)
        config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
                            lora_dropout=0.0)
        model = get_peft_model(base, config)
        with torch.no_grad():
            for key, p in model.named_parameters():
                if "lora_B" in key:
                    p.copy_(torch.randn_like(p) * B_STD)
        partial = f"{folder}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        base = model.unload()
        os.rename(partial, folder)
        print(f"wrote {folder} in {time.perf_counter() - start:.0f}s (once)", flush=True)
    return adapters


def max_model_len(args) -> int:
    return args.max_input + args.max_output + 8


def run_vlinfer(args, prompts, out_lens, adapters, loras):
    """(seconds, outputs): LoRA off when `adapters` is empty (the base model alone), else on,
    request i with adapters[loras[i]]."""
    from vlinfer import LLM, LoRARequest, SamplingParams
    options = dict(enable_lora=True, max_loras=args.adapters,
                   max_lora_rank=args.rank) if adapters else {}
    llm = LLM(peers.hf_folder(args.model), dtype=args.dtype, max_model_len=max_model_len(args),
              **options)
    requests = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters)]
    for r in requests or [None]:  # warm-up, and every adapter read before the clock starts
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False, lora_request=r)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    per_prompt = [requests[i] for i in loras] if requests else None
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    elapsed = time.perf_counter() - start
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    assert sum(map(len, outputs)) == sum(out_lens), (sum(map(len, outputs)), sum(out_lens))
    llm.close()
    return elapsed, outputs


def run_transformers_peft(args, prompts, out_lens, adapters, loras):
    """(seconds, outputs): one PeftModel holding every adapter; each adapter's requests in turn."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(
        peers.dense_model(args.model, args.dtype).eval(), adapters[0][1],
        adapter_name=adapters[0][0])
    for name, path in adapters[1:]:
        model.load_adapter(path, adapter_name=name)
    model = model.to(getattr(torch, args.dtype)).eval()
    for name, _ in adapters:  # warm-up
        model.set_adapter(name)
        model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    outputs = [None] * len(prompts)
    start = time.perf_counter()
    for k, (name, _) in enumerate(adapters):
        rows = [i for i, a in enumerate(loras) if a == k]
        if not rows:
            continue
        model.set_adapter(name)
        got = common.left_padded_generate(model, [prompts[i] for i in rows],
                                          [out_lens[i] for i in rows], args.hf_batch_size)
        for i, out in zip(rows, got):
            outputs[i] = out
    return time.perf_counter() - start, outputs


def run_vllm(args, prompts, out_lens, adapters, loras):
    """(seconds, outputs, note) from the vLLM-CPU peer with the same adapters, or None after
    printing why not."""
    if not peers.usable("vllm", args.model):
        return None
    request = dict(
        model=peers.hf_folder(args.model), dtype=args.dtype, max_model_len=max_model_len(args),
        max_num_seqs=256, kv_cache_gb=args.vllm_kv_cache_gb,
        cpus=peers.cpus(torch.get_num_threads()),
        lora=dict(max_loras=args.adapters, max_lora_rank=args.rank,
                  adapters=[[name, i + 1, path] for i, (name, path) in enumerate(adapters)]),
        runs=[dict(name="batch", prompts=prompts, max_tokens=out_lens, loras=loras, repeat=1)])
    r = peers.try_run("vllm", request)
    if r is None:
        return None
    note = (
        f"vLLM-CPU {r['version']} with LoRA (its CPU backend: torch punica ops, torch.compile off "
        "with LoRA): "
        f"start-up {r['startup_s']:.1f}s (not timed), import {r['import_s']:.1f}s, warm-up "
        f"{r['warmup_s']:.1f}s, "
        f"whole subprocess {r['process_s']:.1f}s; "
        f"{' '.join(f'{k}={v}' for k, v in sorted(r['env'].items()))}")
    return r["runs"]["batch"]["seconds"][0], r["runs"]["batch"]["outputs"], note


def main(argv=None):
    p = common.parser(__doc__)
    common.add_model_arg(p)
    common.add_dtype_arg(p, choices=["bfloat16", "float32"])
    common.add_text_workload_args(p, num_requests=64, max_output=256)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="every request's output length (sets --min-output and --max-output)")
    p.add_argument("--adapters", type=int, default=4,
                   help="distinct adapters, request i runs adapter i mod this")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank (also max_lora_rank)")
    common.add_transformers_args(p, batch_size=64)
    common.add_skip_args(p, "vllm")
    p.add_argument("--vllm-kv-cache-gb", type=int, default=4,
                   help="VLLM_CPU_KVCACHE_SPACE for the vLLM-CPU peer")
    args = p.parse_args(argv)
    if args.max_tokens is not None:
        args.min_output = args.max_output = args.max_tokens
    prompts, out_lens = common.text_workload(args)
    loras = [i % args.adapters for i in range(len(prompts))]
    dims = model_dims(args.model)
    prompt_lens = list(map(len, prompts))
    base_flops = model_flops(dims, prompt_lens, out_lens)
    adapter_flops = lora_flops(dims, args.rank, prompt_lens, out_lens)
    tokens = sum(out_lens)
    print(f"machine: {machine()}")
    print(
        f"workload: {args.num_requests} requests over {args.adapters} adapters (rank {args.rank}, "
        "alpha "
        f"{2 * args.rank}, {'/'.join(t.removesuffix('_proj') for t in TARGETS)} of every layer), "
        "prompts "
        f"{args.min_input}-{args.max_input} ({sum(prompt_lens)} tokens), outputs {args.min_output}-"
        f"{args.max_output} ({tokens} tokens), greedy, EOS ignored, {args.model} {args.dtype}; "
        f"{base_flops / 1e12:.2f} TFLOP of model FLOPs + {adapter_flops / 1e12:.3f} of adapters",
        flush=True)
    adapters = make_adapters(args)
    dtype = getattr(torch, args.dtype)
    peak_before = matmul_peak_gflops(dtype, "cpu")

    # rows: key -> (name, seconds, flops); outputs: key -> token id lists
    rows, notes, outputs = {}, [], {}
    seconds, outputs["base"] = run_vlinfer(args, prompts, out_lens, [], loras)
    rows["base"] = ("vlinfer, base model (no adapters)", seconds, base_flops)
    progress(f"vlinfer base done: {tokens / seconds:.1f} tok/s")
    seconds, outputs["vlinfer"] = run_vlinfer(args, prompts, out_lens, adapters, loras)
    rows["vlinfer"] = (f"vlinfer, LoRA ({args.adapters} adapters in one batch)", seconds,
                       base_flops + adapter_flops)
    progress(f"vlinfer LoRA done: {tokens / seconds:.1f} tok/s")
    if args.skip_vllm:
        print("vLLM-CPU: skipped (--skip-vllm)", flush=True)
    else:
        got = run_vllm(args, prompts, out_lens, adapters, loras)
        if got is not None:
            rows["vllm"] = ("vLLM-CPU, LoRA (same adapters)", got[0], base_flops + adapter_flops)
            outputs["vllm"] = got[1]
            notes.append(got[2])
            progress(f"vLLM-CPU LoRA done: {tokens / got[0]:.1f} tok/s")
    if args.skip_transformers:
        print("transformers + PEFT: skipped (--skip-transformers)", flush=True)
    else:
        seconds, outputs["peft"] = run_transformers_peft(args, prompts, out_lens, adapters, loras)
        rows["peft"] = (f"transformers + PEFT (one adapter at a time, batch {args.hf_batch_size})",
                        seconds, base_flops + adapter_flops)
        progress(f"transformers + PEFT done: {tokens / seconds:.1f} tok/s")
    peak_after = matmul_peak_gflops(dtype, "cpu")
    peak = max(peak_before, peak_after)

    print(f"\nmachine: {machine()}")
    base, ours = rows["base"][1], rows["vlinfer"][1]
    table([
        "engine", "output tokens", "time (s)", "output tok/s", "ratio to base",
        f"share of matmul peak "
        f"({args.dtype})"
    ], [(name, tokens, f"{s:.1f}", f"{tokens / s:.1f}", f"{base / s:.2f}x",
         f"{flops / s / peak / 1e9:.1%}") for name, s, flops in rows.values()])
    print(
        f"\nmatmul peak: {peak:.0f} GFLOP/s {args.dtype} ({CPU_PEAK_PROBE}; "
        f"{peak_before:.0f} before the engines, {peak_after:.0f} after); model FLOPs "
        f"{base_flops / 1e12:.2f} "
        f"TFLOP, adapters {adapter_flops / 1e12:.3f} TFLOP more on the LoRA rows")
    print(f"vlinfer LoRA / base model: {base / ours:.2f}x (target >= 0.8x)")
    if "peft" in rows:
        print(f"vlinfer LoRA / transformers + PEFT: {rows['peft'][1] / ours:.2f}x (target >= 3x)")
    if "vllm" in rows:
        print(f"vlinfer LoRA / vLLM-CPU LoRA: {rows['vllm'][1] / ours:.2f}x")
    changed = sum(a != b for a, b in zip(outputs["base"], outputs["vlinfer"]))
    print(
        f"the adapters change the answers: {changed}/{len(prompts)} vlinfer LoRA outputs differ "
        "from the base "
        f"model's")
    if "peft" in outputs:
        same = sum(a == b for a, b in zip(outputs["vlinfer"], outputs["peft"]))
        per = [
            sum(outputs["vlinfer"][i] == outputs["peft"][i] for i in range(len(prompts))
                if loras[i] == k) for k in range(args.adapters)
        ]
        print(
            "accuracy: vlinfer LoRA greedy outputs identical to transformers + PEFT's: "
            f"{same}/{len(prompts)} "
            f"(per adapter {', '.join(f'{n}/{loras.count(k)}' for k, n in enumerate(per))}); "
            f"{agreement(outputs['peft'], outputs['vlinfer'])} ({args.dtype})")
    else:
        print("accuracy: transformers + PEFT skipped, no reference to compare with")
    if "vllm" in outputs:
        print(
            "greedy outputs vs vlinfer LoRA, vLLM-CPU LoRA: "
            f"{agreement(outputs['vlinfer'], outputs['vllm'])}"
        )
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
