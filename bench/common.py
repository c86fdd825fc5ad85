"""What every bench/ script shares: the machine line and the machine's own limits measured in the
same run (every figure is printed next to the CPU's name and flags, the load, and a share of the
matmul peak or the memory bandwidth measured here), the command-line options the scripts have in
common, the seeded text workload, the random-weight checkpoints built once, greedy generation on
vlinfer and on transformers, and the markdown tables.

Each script puts bench/ on sys.path before `import common` (`vlinfer bench` loads a script by its
path). torch is imported inside the functions that need it: bench/serving.py, a pure HTTP client
with --url, does not load it."""
import argparse
import datetime
import gc
import json
import os
import platform as py_platform
import random
import shutil
import time

# -------------------------------------------------------------------------------------------------
# the machine

# The flags that decide which of our CPU kernels run (and how fast torch's bf16 matmul is).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")


def cpu() -> str:
    """'<model name>, <cores> cores, flags: <the CPU_FLAGS it has>'."""
    name, flags = py_platform.processor() or py_platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    have = " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + " ".join(CPU_FLAGS)
    return f"{name}, {os.cpu_count()} cores, flags: {have}"


def load() -> str:
    """The load average: other processes on a small machine skew every engine's timings."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1/5/15 min)"


def machine(device: str = "cpu") -> str:
    """The CPU, torch and its threads, the time and the load (and the GPU when the engines run on
    one): printed with every figure, since the figures only mean something next to them."""
    import torch
    accelerator = f", {torch.cuda.get_device_name()}" if device.startswith("cuda") else ""
    return (f"{cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}; {load()}{accelerator}")


def progress(text: str) -> None:
    """'<text>; <load>' as each engine finishes: a slow row next to a high load is the machine, not
    the engine."""
    print(f"{text}; {load()}", flush=True)


def synchronize(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


CPU_PEAK_PROBE = ("2048 rows x 2048 <-> 8192 features, the faster of oneDNN prepacked and "
                  "F.linear, best of 5")


def matmul_peak_gflops(dtype, device: str = "cpu") -> float:
    """This machine's matmul rate now: on CPU the best of a few 2048-row matmuls of 2048 -> 8192 and
    8192 -> 2048 features, each on every kernel torch has for it: oneDNN on a prepacked weight (what
    our linear layers run at decode sizes) and F.linear on the plain one (MKL's sgemm in float32:
    the faster at these sizes on some CPUs, the AVX2 EPYC's among them, and faster with the longer
    inner dimension); on a GPU the best of a few 8192^3 torch.matmul."""
    import torch
    if device.startswith("cuda"):
        a = torch.randn(8192, 8192, device=device).to(dtype)
        return 2 * 8192 ** 3 / _best_seconds(lambda: torch.matmul(a, a), device) / 1e9
    seconds = float("inf")
    for k, n in ((2048, 8192), (8192, 2048)):
        x, weight = torch.randn(2048, k).to(dtype), torch.randn(n, k).to(dtype)
        seconds = min(seconds, _best_seconds(lambda: torch.nn.functional.linear(x, weight), device))
        # else oneDNN packs no bf16
        if dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            seconds = min(
                seconds,
                _best_seconds(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                    device))
    return 2 * 2048 * 2048 * 8192 / seconds / 1e9


def _best_seconds(matmul, device: str, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        matmul()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def bandwidth_gbs() -> tuple[float, float]:
    """(read, copy) GB/s now: best of 5 sums of a 1 GiB float32 tensor (reads it once) and copies of
    a 512 MiB one (reads and writes it once), far beyond any cache."""
    import torch
    big = torch.ones(2 ** 28)
    src, dst = torch.ones(2 ** 27), torch.empty(2 ** 27)
    read = copy = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - start)
    return big.nbytes / read / 1e9, 2 * src.nbytes / copy / 1e9


# -------------------------------------------------------------------------------------------------
# arguments

def parser(doc: str) -> argparse.ArgumentParser:
    """The script's docstring, kept as written, is its --help."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


DTYPES = ["bfloat16", "float32", "float16"]


def add_model_arg(p, default: str = "smollm2") -> None:
    p.add_argument("--model", default=default,
                   help=f"an alias, a folder or a GGUF file (default {default})")


def add_dtype_arg(p, default: str = "bfloat16", choices=DTYPES) -> None:
    p.add_argument("--dtype", default=default, choices=choices)


QUANTIZATIONS = ("none", "int8", "int4")  # LLM(quantization=...) on load; "none" keeps the weights


def add_quantization_arg(p) -> None:
    p.add_argument(
        "--quantization", default="none", type=lambda v: v.split(","),
        help="comma-separated weight quantizations on load, one vlinfer run each: "
        f"{', '.join(QUANTIZATIONS)} (e.g. none,int8)")


def quantization(name: str) -> str | None:
    """The LLM(quantization=...) of one --quantization entry (a clear error for an unknown one)."""
    if name not in QUANTIZATIONS:
        raise SystemExit(f"--quantization {name!r}: expected one of {', '.join(QUANTIZATIONS)}")
    return None if name == "none" else name


def add_seed_arg(
        p,
        help: str = "seed of the workload: the same inputs for every engine and every run") -> None:
    p.add_argument("--seed", type=int, default=0, help=help)


def add_transformers_args(p, batch_size: int) -> None:
    """The transformers `generate` peer every side-by-side script runs in-process."""
    p.add_argument("--hf-batch-size", type=int, default=batch_size)
    p.add_argument("--skip-transformers", action="store_true")


def add_skip_args(p, *peers: str) -> None:
    """--skip-vllm, --skip-llamacpp: the subprocess peers (bench/peers) a script runs when
    installed."""
    for peer in peers:
        p.add_argument(f"--skip-{peer.replace('.', '')}", action="store_true")


def add_single_stream_args(p) -> None:
    """One prompt alone and the whole request, best of --repeat (see single_stream_runs)."""
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)


def add_text_workload_args(p, num_requests: int, max_output: int) -> None:
    """The text batch workload (see text_workload), given on the command line as ranges."""
    p.add_argument("--num-requests", type=int, default=num_requests)
    p.add_argument("--min-input", type=int, default=32)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=max_output)
    add_seed_arg(p)


# -------------------------------------------------------------------------------------------------
# workloads

def token_ids(rng: random.Random, n: int) -> list[int]:
    """n seeded random token ids, clear of the special tokens at either end of the vocabularies
    benchmarked."""
    return [rng.randrange(100, 40000) for _ in range(n)]


def text_workload(args) -> tuple[list[list[int]], list[int]]:
    """(prompts as token ids, output length of each): seeded random, the same for every engine of a
    run and every run of a seed."""
    rng = random.Random(args.seed)
    prompts = [
        token_ids(rng, rng.randint(args.min_input, args.max_input))
        for _ in range(args.num_requests)
    ]
    outputs = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_requests)]
    return prompts, outputs


def single_stream_runs(prompt: list[int], output_len: int, repeat: int) -> list[dict]:
    """The prompt alone (1 token) and the whole request, as peers.protocol.time_runs takes them: the
    difference is the decode time, with the prefill taken out (see decode_rate)."""
    return [dict(name="prompt", prompts=[prompt], max_tokens=[1], repeat=repeat),
            dict(name="whole", prompts=[prompt], max_tokens=[output_len], repeat=repeat)]


def decode_rate(runs: dict, output_len: int) -> tuple[float, float, float]:
    """(best prompt-alone seconds, best whole-request seconds, decode tok/s) of single_stream_runs'
    results."""
    first, whole = min(runs["prompt"]["seconds"]), min(runs["whole"]["seconds"])
    return first, whole, (output_len - 1) / (whole - first)


def model_dims(model: str) -> dict:
    """A text model's shapes and its linear parameters per forwarded token (layers) and per sampled
    token (head)."""
    from vlinfer import loading
    c = loading.load_config(loading.resolve_model(model)).get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    d = dict(layers=c.num_hidden_layers, hidden=c.hidden_size,
             q_dim=c.num_attention_heads * head_dim, kv_dim=c.num_key_value_heads * head_dim,
             intermediate=c.intermediate_size, vocab=c.vocab_size,
             tied=bool(getattr(c, "tie_word_embeddings", False)))
    h = d["hidden"]
    d["layer_params"] = d["layers"] * (h * (2 * d["q_dim"] + 2 * d["kv_dim"]) +
                                       3 * h * d["intermediate"])
    d["head_params"] = h * d["vocab"]
    return d


def random_checkpoint(folder: str, what: str, model_class: str, make_config, dtype, seed: int,
                      files: dict | None = None, init=None) -> str:
    """A random-weight checkpoint in `folder`, built once and reused afterwards: transformers'
    `model_class` with its default init (seeded; then init(model) where given) saved as
    safetensors, the Qwen tokenizer, and `files` (name -> JSON). Built into a temporary folder
    renamed when complete, so an interrupted build is never mistaken for a finished one."""
    folder = os.path.abspath(os.path.expanduser(folder))
    if os.path.exists(os.path.join(folder, ".complete")):
        return folder
    import torch
    import transformers
    from vlinfer.toy.tiny_checkpoints import qwen_tokenizer_files
    print(f"building the random {what} checkpoint in {folder} (once) ...", flush=True)
    start = time.perf_counter()
    torch.manual_seed(seed)
    # Built directly in `dtype`: one copy in RAM.
    model = getattr(transformers, model_class)._from_config(make_config(), dtype=dtype).eval()
    if init is not None:
        init(model)
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    model.save_pretrained(partial, safe_serialization=True)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    tokenizer_dir = qwen_tokenizer_files()
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), partial)
    for name, content in (files or {}).items():
        with open(os.path.join(partial, name), "w") as f:
            json.dump(content, f, indent=2)
    open(os.path.join(partial, ".complete"), "w").close()
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(partial, folder)
    print(f"built {num_params / 1e9:.2f}B parameters in {time.perf_counter() - start:.0f}s",
          flush=True)
    return folder


# -------------------------------------------------------------------------------------------------
# generation

def greedy(llm):
    """generate(prompts, max_tokens) -> token id lists on a vlinfer LLM: greedy, EOS ignored, so
    every engine of a run generates exactly the requested tokens."""
    from vlinfer import SamplingParams

    def generate(prompts, max_tokens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return generate


def left_padded_generate(model, prompts, out_lens, batch_size: int,
                         pad: int = 0) -> list[list[int]]:
    """transformers `generate` over left-padded batches: each batch generates its longest requested
    output and only the requested tokens of each row are kept, so it counts the same tokens as the
    other engines."""
    import torch
    outputs = []
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], out_lens[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=model.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max(lens),
                                 min_new_tokens=max(lens), do_sample=False, pad_token_id=pad)
        outputs.extend(row[width:width + n] for row, n in zip(out.tolist(), lens))
    return outputs


# -------------------------------------------------------------------------------------------------
# tables

def markdown(header: list[str], rows, right: bool = False) -> str:
    """A markdown table of preformatted cells (an empty one stays '| |'); right=True right-aligns
    every column but the first."""
    def line(cells):
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"

    rule = "|---|" + ("---:|" if right else "---|") * (len(header) - 1)
    return "\n".join([line(header), rule] + [line(r) for r in rows])


def table(header: list[str], rows, right: bool = False) -> None:
    """Print markdown(...) after a blank line, the way every script sets its tables apart."""
    print(f"\n{markdown(header, rows, right)}")
