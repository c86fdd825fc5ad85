"""What the apps share (`python -m vlinfer generate|chat|caption`, `serve`, apps/demo.py): the
engine flags, with the defaults of README.md's defaults table, and the names of settings in
messages.

The engine's errors and warnings name its keyword arguments (`max_model_len=...`, `raise
kv_cache_bytes`), which is what a Python caller can set; an app's user set flags, so an app shows
those messages with its flags instead (`--max-model-len=...`, `raise --kv-cache-size`): name_flags
on errors, flags_in_logs on the engine's log."""
import argparse
import contextlib
import dataclasses
import logging
import re

from vlinfer.config import (ACCELERATOR_DEFAULT_MEMORY_UTILIZATION, APP_MAX_MODEL_LEN,
                            CPU_DEFAULT_MEMORY_UTILIZATION, DEFAULT_MAX_BATCHED_TOKENS,
                            KV_CACHE_DTYPE_NAMES, MIN_BATCHED_TOKENS, RUNNERS,
                            SSM_CACHE_DTYPE_NAMES, EngineConfig)
from vlinfer.structured.reasoning import REASONING_PARSER_CHOICES

# Keyword argument (LLM / EngineConfig / SamplingParams) -> the flag that sets it in every app.
FLAGS = {
    "device": "--device",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "max_model_len_cap": "the default --max-model-len cap",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_num_seqs": "--max-num-seqs",
    "kv_cache_bytes": "--kv-cache-size",
    "memory_utilization": "--memory-utilization",
    "tensor_parallel_size": "--tensor-parallel-size",
    "num_threads": "--num-threads",
    "kvcache_block_size": "--block-size",
    "enable_prefix_caching": "--enable-prefix-caching",
    "ops": "--ops",
    "enforce_eager": "--enforce-eager",
    "enable_expert_parallel": "--enable-expert-parallel",
    "distributed_init_method": "--distributed-init-method",
    "distributed_timeout_s": "--distributed-timeout",
    "distributed_startup_timeout_s": "--distributed-startup-timeout",
    "quantization": "--quantization",
    "allow_image_urls": "--allow-image-urls",
    "logprobs_mode": "--logprobs-mode",
    "kv_cache_dtype": "--kv-cache-dtype",
    "mamba_ssm_cache_dtype": "--mamba-ssm-cache-dtype",
    "language_model_only": "--language-model-only",
    "enable_lora": "--enable-lora",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
    "max_cpu_loras": "--max-cpu-loras",
    "runner": "--runner",
    "hf_overrides": "--hf-overrides",
    "speculative_config": "--speculative-config",
    "reasoning_parser": "--reasoning-parser",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "max_tokens": "--max-tokens",
    "seed": "--seed",
}
ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)
                   if f.default is not dataclasses.MISSING}


def json_object(text: str) -> dict:
    """A JSON object flag value (--hf-overrides, --speculative-config)."""
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is expected")
    return value


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1048576' -> bytes."""
    units = {"k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)") from None


def add_engine_args(p: argparse.ArgumentParser, *, max_num_seqs: bool = True) -> None:
    """The engine flags; defaults are the engine's own (None: the engine decides, as for LLM(...)),
    except the context length, capped at APP_MAX_MODEL_LEN in engine_options. max_num_seqs=False:
    the app sets it itself."""
    p.add_argument("--device", default=ENGINE_DEFAULTS["device"],
                   help="cpu, cuda, cuda:1, npu, ... (default: auto)")
    p.add_argument("--dtype", default=ENGINE_DEFAULTS["dtype"],
                   help="float32, bfloat16, float16 (default: auto)")
    p.add_argument(
        "--max-model-len", type=int, default=None, metavar="TOKENS", help=
        "longest prompt + answer in tokens (default: the model's own, at most "
        f"{APP_MAX_MODEL_LEN}, "
        "and at most what the KV cache holds)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, metavar="TOKENS", help=
        "tokens per engine step; longer prompts prefill in chunks (default: the context length, "
        "at "
        f"most {DEFAULT_MAX_BATCHED_TOKENS}, at least {MIN_BATCHED_TOKENS})")
    if max_num_seqs:
        p.add_argument(
            "--max-num-seqs", type=int, default=ENGINE_DEFAULTS["max_num_seqs"], metavar="N",
            help=f"sequences the engine runs at once (default: {ENGINE_DEFAULTS['max_num_seqs']})")
    p.add_argument(
        "--kv-cache-size", dest="kv_cache_bytes", type=parse_size, default=None, metavar="SIZE",
        help=
        "KV cache pool, e.g. 512M or 2G (default: a share of free memory, see --memory-utilization)"
    )
    p.add_argument(
        "--memory-utilization", type=float, default=None, metavar="SHARE", help=
        "share of memory for the KV cache when --kv-cache-size is not given: of the RAM free after "
        f"loading on CPU (default {CPU_DEFAULT_MEMORY_UTILIZATION}), of device memory on "
        "accelerators "
        f"(default {ACCELERATOR_DEFAULT_MEMORY_UTILIZATION})")
    p.add_argument("--tensor-parallel-size", type=int,
                   default=ENGINE_DEFAULTS["tensor_parallel_size"], metavar="N",
                   help="split the model over N ranks (default: 1)")
    p.add_argument(
        "--num-threads", type=int, default=None, metavar="N", help=
        "CPU threads of this process (default: torch's, i.e. every core; under tensor parallelism "
        "the cores divided by --tensor-parallel-size, since the ranks share them)")
    p.add_argument("--block-size", dest="kvcache_block_size", type=int, default=None,
                   metavar="TOKENS", help="tokens per KV block (default: the device's, 16 on CPU)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=ENGINE_DEFAULTS["enable_prefix_caching"],
                   help="reuse the KV of shared prompt prefixes")
    p.add_argument(
        "--ops", default=None, choices=["cpu-compiled", "reference", "cuda", "npu"],
        help="force one op implementation (default: $VLINFER_OPS, else the device's own kernels)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no captured decode graphs (CUDA, NPU)")
    p.add_argument(
        "--enable-expert-parallel", action="store_true",
        help="MoE under tensor parallelism: whole experts per rank instead of sliced experts")
    p.add_argument(
        "--distributed-init-method", default=None, metavar="URL",
        help="where tensor-parallel ranks meet: tcp://host:port or env:// (default: local workers)")
    p.add_argument("--distributed-timeout", dest="distributed_timeout_s", type=float,
                   default=ENGINE_DEFAULTS["distributed_timeout_s"], metavar="S",
                   help=f"seconds a rank waits for the others in a step (default: "
                        f"{ENGINE_DEFAULTS['distributed_timeout_s']:g})")
    p.add_argument(
        "--distributed-startup-timeout", dest="distributed_startup_timeout_s", type=float,
        default=ENGINE_DEFAULTS["distributed_startup_timeout_s"], metavar="S",
        help=f"seconds for the workers to start and load (default: "
        f"{ENGINE_DEFAULTS['distributed_startup_timeout_s']:g})")
    p.add_argument(
        "--quantization", default=None, choices=["int8", "int4"],
        help="quantize a dense checkpoint's weights on load (default: as the checkpoint is)")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs from public hosts (default: refused)")
    p.add_argument(
        "--logprobs-mode", default=ENGINE_DEFAULTS["logprobs_mode"], choices=["raw_logprobs"],
        help="which logprobs requests get: vLLM's default raw_logprobs, the only one offered")
    p.add_argument(
        "--kv-cache-dtype", default=ENGINE_DEFAULTS["kv_cache_dtype"],
        choices=list(KV_CACHE_DTYPE_NAMES), help=
        "the dtype K and V are stored in: auto (the model's), or a smaller one that holds more "
        "tokens "
        "(bfloat16, float16, fp8 = fp8_e4m3, fp8_e5m2, int8)")
    p.add_argument(
        "--mamba-ssm-cache-dtype", default=ENGINE_DEFAULTS["mamba_ssm_cache_dtype"],
        choices=list(SSM_CACHE_DTYPE_NAMES), help=
        "the dtype hybrid models (Qwen3.5, Qwen3-Next) store their linear layers' recurrent state "
        "in: auto (float32), or bfloat16 / float16, which hold more sequences (docs/hybrid.md)")
    p.add_argument(
        "--language-model-only", action="store_true", help=
        "run a vision-language checkpoint as its language model alone: no vision tower built, "
        "requests with images or videos refused")
    p.add_argument(
        "--enable-lora", action="store_true", help=
        "serve LoRA adapters (PEFT folders) per request; on by itself with --lora, --lora-modules "
        "or "
        "--allow-runtime-lora-updating (docs/lora.md)")
    p.add_argument(
        "--max-loras", type=int, default=ENGINE_DEFAULTS["max_loras"], metavar="N",
        help=f"distinct adapters in one engine step (default: {ENGINE_DEFAULTS['max_loras']})")
    p.add_argument(
        "--max-lora-rank", type=int, default=ENGINE_DEFAULTS["max_lora_rank"], metavar="R",
        help=f"highest adapter rank accepted (default: {ENGINE_DEFAULTS['max_lora_rank']})")
    p.add_argument("--max-cpu-loras", type=int, default=ENGINE_DEFAULTS["max_cpu_loras"],
                   metavar="N", help="adapters kept read in host memory (default: --max-loras)")
    p.add_argument(
        "--runner", default=ENGINE_DEFAULTS["runner"], choices=list(RUNNERS), help=
        "generate, or pooling (embeddings and scores: docs/retrieval.md); auto picks pooling for a "
        "classifier or a checkpoint without an LM head (default: auto)")
    p.add_argument(
        "--hf-overrides", type=json_object, default=None, metavar="JSON",
        help="config.json fields to replace, as vLLM's --hf-overrides, e.g. a Qwen3-VL reranker's "
        "'{\"architectures\": [\"Qwen3VLForSequenceClassification\"], ...}'")
    p.add_argument(
        "--speculative-config", type=json_object, default=None, metavar="JSON",
        help="speculative decoding, as vLLM's --speculative-config: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' or "
        "'{\"model\": DRAFT, \"num_speculative_tokens\": 4}' or, on Qwen3.5 / Qwen3-Next, "
        "'{\"method\": \"mtp\", \"num_speculative_tokens\": 3}' (docs/speculative.md)")
    p.add_argument(
        "--reasoning-parser", default=ENGINE_DEFAULTS["reasoning_parser"],
        choices=list(REASONING_PARSER_CHOICES), help=
        "split the thinking (<think> ... </think>) from the answer, as vLLM's --reasoning-parser: "
        "qwen3, none, or auto: qwen3 when the chat template thinks (default: auto; "
        "docs/reasoning.md)")
    p.add_argument(
        "--seed", type=int, default=None,
        help="the engine's seed for unseeded requests; the apps' own requests use it too "
             "(default: "
        f"{ENGINE_DEFAULTS['seed']})")


ADVANCED = "advanced options"


def advanced_group(p: argparse.ArgumentParser):
    """The help's second section: the engine and limit flags, after the options most runs set."""
    found = [g for g in p._action_groups if g.title == ADVANCED]
    return found[0] if found else p.add_argument_group(
        ADVANCED, "engine settings and limits (their defaults: README.md's Defaults)")


def compact_usage(p: argparse.ArgumentParser) -> str:
    """'prog POSITIONAL ... [options]': the full list is the help itself."""
    positionals = [a.metavar or a.dest for a in p._actions
                   if not a.option_strings and a.dest != "command"]
    return " ".join(["%(prog)s", *positionals, "[options]"])


def add_json_whitespace_arg(p) -> None:
    """The one flag for free whitespace in constrained JSON (serve, caption --json-schema); its
    default is StructuredOutputsParams' own."""
    from vlinfer.structured.params import StructuredOutputsParams
    p.add_argument(
        "--structured-outputs-disable-any-whitespace", action=argparse.BooleanOptionalAction,
        default=StructuredOutputsParams.disable_any_whitespace,
        help="constrained JSON has no free whitespace (vLLM's disable_any_whitespace; in the "
        "server a request's own structured_outputs wins). Default on: small models otherwise pad "
        "JSON with newlines until max_tokens")


def set_threads(args: argparse.Namespace) -> None:
    """The app owns its process: set torch's CPU thread count from --num-threads
    (platform/threads.py). The engine never does; each spawned tensor-parallel worker sets its own
    share."""
    from vlinfer.platform import cores_per_rank, set_process_threads
    threads = args.num_threads
    if threads is None and args.tensor_parallel_size > 1:
        threads = cores_per_rank(args.tensor_parallel_size)
    if threads is not None:
        set_process_threads(threads)


def engine_options(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from add_engine_args' flags."""
    options = dict(
        device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_model_len_cap=APP_MAX_MODEL_LEN, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_bytes=args.kv_cache_bytes, memory_utilization=args.memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size, kvcache_block_size=args.kvcache_block_size,
        enable_prefix_caching=args.enable_prefix_caching, ops=args.ops,
        enforce_eager=args.enforce_eager, enable_expert_parallel=args.enable_expert_parallel,
        distributed_init_method=args.distributed_init_method,
        distributed_timeout_s=args.distributed_timeout_s,
        distributed_startup_timeout_s=args.distributed_startup_timeout_s,
        quantization=args.quantization, allow_image_urls=args.allow_image_urls,
        logprobs_mode=args.logprobs_mode, kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        language_model_only=args.language_model_only,
        enable_lora=lora_enabled(args), max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, runner=args.runner, hf_overrides=args.hf_overrides,
        speculative_config=args.speculative_config, reasoning_parser=args.reasoning_parser,
        seed=ENGINE_DEFAULTS["seed"] if args.seed is None else args.seed)
    if hasattr(args, "max_num_seqs"):
        options["max_num_seqs"] = args.max_num_seqs
    return options


def lora_enabled(args: argparse.Namespace) -> bool:
    """--enable-lora, or an app flag that needs it: an adapter for every request (generate, chat,
    caption --lora), the server's --lora-modules or --allow-runtime-lora-updating."""
    return args.enable_lora or any(
        getattr(args, name, None)
        for name in ("lora", "lora_modules", "allow_runtime_lora_updating"))


def _pattern(names) -> re.Pattern:
    """A keyword name as messages write it: `SamplingParams.top_p`, or the bare name where it cannot
    be an English word: names with an underscore anywhere, one-word names (device, seed) only as
    `name=`."""
    alternatives = []
    for name in sorted(names, key=len, reverse=True):
        alternatives.append(rf"\bSamplingParams\.{name}\b")
        alternatives.append(rf"\b{name}\b" if "_" in name else rf"\b{name}(?==)")
    return re.compile("|".join(alternatives))


def name_flags(message: str, flags: dict[str, str] = FLAGS) -> str:
    """An engine message with each keyword name replaced by the app's flag: 'max_model_len=8192 ...
    raise kv_cache_bytes' -> '--max-model-len=8192 ... raise --kv-cache-size'."""
    if not flags:
        return message
    return _pattern(flags).sub(lambda m: flags[m.group(0).removeprefix("SamplingParams.")], message)


class _FlagNames(logging.Filter):
    def __init__(self, flags: dict[str, str]):
        super().__init__()
        self.flags = flags

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = name_flags(record.getMessage(), self.flags), None
        return True


@contextlib.contextmanager
def flags_in_logs(flags: dict[str, str] = FLAGS):
    """While an app runs, the engine's log lines (logger "vlinfer") name its flags; removed after,
    so nothing of the app stays on the logger."""
    logger, names = logging.getLogger("vlinfer"), _FlagNames(flags)
    logger.addFilter(names)
    try:
        yield
    finally:
        logger.removeFilter(names)
