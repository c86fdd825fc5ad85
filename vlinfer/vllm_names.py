"""vLLM's keyword names as vlinfer takes them: every `vllm.LLM` / `EngineArgs` keyword either works
with vLLM's meaning (ours by the same name or an alias), changes nothing here and is accepted with a
logged note, or is refused with a ValueError naming it, why, and what to use. An unknown keyword is
refused with the name it is closest to (`did_you_mean`, which SamplingParams shares)."""
import difflib
import logging
from dataclasses import fields

from vlinfer.config import EngineConfig

logger = logging.getLogger("vlinfer")

# vLLM's keywords that are ours by the same name and meaning (EngineConfig's fields)
SAME = ("dtype", "kv_cache_dtype", "seed", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "enable_prefix_caching", "enforce_eager", "tensor_parallel_size",
        "enable_expert_parallel", "quantization", "hf_overrides", "logprobs_mode", "runner",
        "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "speculative_config",
        "reasoning_parser")
# vLLM's name -> ours, same meaning
ALIASES = {
    "gpu_memory_utilization": "memory_utilization",
    "block_size": "kvcache_block_size",
    "kv_cache_memory_bytes": "kv_cache_bytes",
}

# Accepted at any value: there is nothing here for them to change. The note is logged (info) so a
# user reading the log sees that the keyword did nothing.
NO_EFFECT = {
    "trust_remote_code": "vlinfer never runs a checkpoint's remote code: its own model classes "
                         "run every supported architecture",
    "swap_space": "does nothing here: preempted requests are recomputed, never swapped to CPU",
    "cpu_offload_gb": "does nothing here: weights are not offloaded (CPU is a device of its own: "
                      "device='cpu')",
    "disable_log_stats": "does nothing here: the engine logs no periodic statistics",
    "disable_log_requests": "does nothing here: requests are not logged one by one",
    "disable_custom_all_reduce": "does nothing here: tensor parallelism uses torch.distributed's "
                                 "all-reduce",
    "max_seq_len_to_capture": "does nothing here: decode graphs are captured per batch size",
    "cuda_graph_sizes": "does nothing here: decode graphs are captured per batch size",
    "compilation_config": "does nothing here: no torch.compile; graphs follow enforce_eager",
    "use_tqdm_on_load": "does nothing here: loading shows no progress bar",
    "max_parallel_loading_workers": "does nothing here: each rank reads its own shard",
    "enable_chunked_prefill": "does nothing here: long prompts always prefill in chunks of "
                              "max_num_batched_tokens (vLLM V1's rule)",
    "disable_mm_preprocessor_cache": "does nothing here: images are preprocessed per request",
    "mm_processor_cache_gb": "does nothing here: images are preprocessed per request",
    "num_lookahead_slots": "does nothing here: speculative decoding sizes its own slots",
}

# Accepted at the values that mean what vlinfer does (vLLM's defaults, mostly); any other value is
# refused with the reason and what to use instead.
ONLY = {
    "pipeline_parallel_size": ((1,), "pipeline parallelism is not offered; use "
                                     "tensor_parallel_size"),
    "data_parallel_size": ((1,), "data parallelism is not offered; run one LLM per device"),
    "distributed_executor_backend": ((None, "mp", "external_launcher"),
                                     "ranks are local processes (or torchrun's); Ray executors "
                                     "are not offered"),
    "tokenizer": ((None,), "the tokenizer is read from the model's folder; put it there"),
    "tokenizer_mode": (("auto",), "the model folder's fast tokenizer is used"),
    "skip_tokenizer_init": ((False,), "the engine needs its tokenizer for text and stops"),
    "revision": ((None,), "models are found locally (aliases, folders, .gguf); check out the "
                          "revision into a folder and pass its path"),
    "tokenizer_revision": ((None,), "the tokenizer is read from the model's folder"),
    "code_revision": ((None,), "remote code never runs here"),
    "download_dir": ((None,), "models are found locally; `huggingface-cli download` fetches them"),
    "hf_token": ((None,), "models are found locally; `huggingface-cli download` fetches them"),
    "load_format": (("auto", "safetensors", "gguf"), "safetensors and .gguf checkpoints are read "
                                                    "as found"),
    "config_format": (("auto", "hf"), "config.json is read in Hugging Face's format"),
    "task": ((None, "auto"), "use runner='generate' or runner='pooling'"),
    "convert": ((None, "auto", "none"), "use runner='pooling' for embeddings and scores"),
    "max_logprobs": ((20,), "logprobs and prompt_logprobs are capped at 20 alternatives"),
    "enable_sleep_mode": ((False,), "sleep / wake_up are not offered; close() the LLM"),
    "async_scheduling": ((False,), "the engine schedules and runs steps in turn"),
    "disable_sliding_window": ((False,), "sliding-window attention follows the model's config"),
    "num_gpu_blocks_override": ((None,), "use kv_cache_bytes for an exact KV pool size"),
    "preemption_mode": ((None, "recompute"), "preempted requests are recomputed"),
    "scheduling_policy": (("fcfs",), "requests are scheduled first come, first served"),
    "model_impl": (("auto", "vllm"), "vlinfer's own model classes run"),
    "rope_scaling": ((None,), "use hf_overrides={'rope_scaling': ...}"),
    "rope_theta": ((None,), "use hf_overrides={'rope_theta': ...}"),
    "logits_processors": ((None, [], ()), "custom logits processors are not offered"),
    "pooler_config": ((None,), "pooling follows the model (runner='pooling'); see "
                               "docs/retrieval.md"),
    "override_pooler_config": ((None,), "pooling follows the model (runner='pooling'); see "
                                        "docs/retrieval.md"),
    "structured_outputs_config": ((None,), "structured outputs always run on llguidance"),
    "guided_decoding_backend": ((None, "auto", "guidance"), "structured outputs always run on "
                                                            "llguidance ('guidance')"),
    "mm_processor_kwargs": ((None,), "pass mm_processor_kwargs per request to generate / chat"),
    "limit_mm_per_prompt": ((None,), "media per prompt are limited by vlinfer.inputs.limits"),
    "allowed_local_media_path": ((None, ""), "local image paths are read as given in "
                                             "generate / chat (the server reads none)"),
    "kv_transfer_config": ((None,), "disaggregated prefill is not offered"),
    "enable_lora_bias": ((False,), "LoRA adapters with biases are not offered"),
    "fully_sharded_loras": ((False,), "LoRA weights are sharded as their base layers are"),
    "served_model_name": ((None,), "a server option: `vlinfer serve --served-model-name`"),
}


def did_you_mean(name: str, known) -> str:
    """' (did you mean 'x'?)' for the known name closest to a typo, or ''."""
    guess = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {guess[0]!r}?)" if guess else ""


def _is_one_of(value, allowed: tuple) -> bool:
    # 1 == True in Python; a bool passed for an int (or the reverse) is not the allowed value
    return any(value == a and type(value) is type(a) for a in allowed if a is not None) or \
        (value is None and None in allowed)


def engine_config(model: str, **options) -> EngineConfig:
    """EngineConfig from LLM(model, **options) as vLLM's LLM takes them: ours, vLLM's aliases,
    vLLM's keywords that change nothing here (a logged note), and the rest refused together in one
    ValueError, each named with why and what to use."""
    ours = {f.name for f in fields(EngineConfig) if f.init}
    taken, problems = {}, []
    for name, value in options.items():
        if name in ours:
            taken[name] = value
        elif name in ALIASES:
            if ALIASES[name] in options:
                problems.append(f"{name} (vLLM's name) and {ALIASES[name]} are the same option: "
                                "give one")
            taken[ALIASES[name]] = value
        elif name in NO_EFFECT:
            logger.info("%s=%r: %s", name, value, NO_EFFECT[name])
        elif name in ONLY:
            allowed, why = ONLY[name]
            if not _is_one_of(value, allowed):
                problems.append(f"{name}={value!r} is not supported: {why}")
        else:
            problems.append(f"LLM has no option {name!r}" +
                            did_you_mean(name, ours | set(ALIASES) | set(NO_EFFECT) | set(ONLY)))
    if "model" in taken:
        problems.append("model is given twice: pass it once, as the first argument")
    if problems:
        raise ValueError("; ".join(problems))
    return EngineConfig(model=model, **taken)
