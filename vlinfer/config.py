from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from vlinfer.structured.reasoning import REASONING_PARSER_CHOICES

INIT_SCHEMES = ("tcp://", "env://", "file://")  # the rendezvous URLs torch.distributed understands
# A max_model_len fitted to the KV cache is at least this long (or the model's own length when
# shorter): room for a useful prompt and answer. A pool that holds fewer tokens is an error.
MIN_FITTED_MODEL_LEN = 2048
# The default max_num_batched_tokens (tokens per engine step), as vLLM bounds it: never the whole
# context of a 262144-position model in one step (longer prompts prefill in chunks, batched with
# other requests' decodes), and on accelerators the memory profile that sizes the KV pool runs one
# step of it, so it must stay small next to the pool it measures. At least MIN_BATCHED_TOKENS, so
# short-context models still batch several prompts per step.
DEFAULT_MAX_BATCHED_TOKENS = 8192
MIN_BATCHED_TOKENS = 2048
# The KV budget when neither kv_cache_bytes nor memory_utilization is given (engine/sizing.py).
CPU_DEFAULT_MEMORY_UTILIZATION = 0.4  # of the RAM still free after the weights are loaded
# of the device's total memory (weights and a profiled step included)
ACCELERATOR_DEFAULT_MEMORY_UTILIZATION = 0.9
# The CLI, the server and the demo run at the model's own context length, at most this
# (max_model_len_cap), when no --max-model-len is given: enough for a chat with images, without a
# pool sized for 262144-token contexts.
APP_MAX_MODEL_LEN = 8192
# Sampling defaults of the entry points that differ from SamplingParams' (vLLM's); README.md
# "Defaults" says why.
# Pipeline, `vlinfer generate`, `vlinfer chat`, the demo: room for a full answer
ANSWER_MAX_TOKENS = 512
# `vlinfer caption`: captions are short, and a batch ends with its longest one
CAPTION_MAX_TOKENS = 128
# the prompt of a caption, and of Pipeline given an image or a video alone
DESCRIBE_IMAGE_PROMPT = "Describe this image."
DESCRIBE_VIDEO_PROMPT = "Describe this video."
CHAT_TEMPERATURE = 0.7  # the chat UIs (`vlinfer chat`, the demo): varied replies that stay on topic
CHAT_TOP_P = 0.9
# kv_cache_dtype names (vLLM's) -> the dtype K and V are stored in; "auto" stores the compute dtype.
# fp8 caches carry one float32 scale per layer for K and one for V (1.0 unless the checkpoint has
# them); int8 caches one float32 scale per token and KV head, written beside the row when it is
# stored (ops/reference/kv_cache.py).
# (torch's dtypes by name, so that reading this module, as the CLI's --help does, imports no torch)
KV_CACHE_DTYPE_NAMES = {
    "auto": None, "bfloat16": "bfloat16", "float16": "float16", "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8"
}
# mamba_ssm_cache_dtype names (vLLM's) -> the dtype the linear-attention layers' recurrent state is
# stored in (hybrid models, docs/hybrid.md); "auto" is float32: the state sums every past token, so
# a 16-bit store rounds a running sum each step. The ops compute in float32 either way.
SSM_CACHE_DTYPE_NAMES = {"auto": "float32", "float32": "float32", "bfloat16": "bfloat16",
                         "float16": "float16"}


def __getattr__(name: str):
    """KV_CACHE_DTYPES and SSM_CACHE_DTYPES: the name tables above with torch's dtypes."""
    tables = {"KV_CACHE_DTYPES": KV_CACHE_DTYPE_NAMES, "SSM_CACHE_DTYPES": SSM_CACHE_DTYPE_NAMES}
    if name not in tables:
        raise AttributeError(f"module 'vlinfer.config' has no attribute {name!r}")
    import torch
    return {key: None if value is None else getattr(torch, value)
            for key, value in tables[name].items()}


RUNNERS = ("auto", "generate", "pooling")
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's speculative methods vlinfer does not run yet, and why (a refusal names the reason)
UNOFFERED_SPECULATIVE_METHODS = {
    **{m: "EAGLE heads are not offered: they need the target's hidden states per position"
       for m in ("eagle", "eagle3")},
    "medusa": "Medusa heads are not offered",
}
# speculative_config's default number of proposed tokens per step, and the batch above which no step
# proposes (verifying k + 1 tokens per sequence then costs more compute than the weight reads it
# saves: docs/speculative.md).
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config, checked: proposals from n-grams of the sequence itself
    ("ngram"), from a smaller draft model with the same vocabulary ("draft_model", given by
    "model") or from the checkpoint's own MTP head ("mtp": Qwen3.5, Qwen3-Next), verified by
    the target model in one forward of k + 1 tokens per sequence (engine/speculative/)."""
    method: str
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    # ngram: the longest suffix of prompt + output, from prompt_lookup_max tokens down to
    # prompt_lookup_min, found earlier in the sequence proposes the tokens that followed it. vLLM's
    # rule: one given, the other equals it.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model: its checkpoint (a path or an alias)
    draft_tensor_parallel_size: int = 1  # the draft runs whole on rank 0: only 1 is offered
    # vLLM's disable_by_batch_size: no proposals in a step with more running sequences than this.
    disable_by_batch_size: int = DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE
    # vlinfer's: proposals stop where they do not pay (engine/speculative/speculator.py: sequences
    # whose proposals keep failing pause; each batch size keeps whichever of proposing or not emits
    # more tokens a second, measured). False: propose whenever the budget allows (for measurements
    # and tests).
    adaptive: bool = True

    @classmethod
    def of(cls, value: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a dict (vLLM's shape), got {type(value).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (supported: "
                             f"{', '.join(sorted(known))}; EAGLE heads are not offered)")
        fields = dict(value)
        fields.setdefault("method", "draft_model" if fields.get("model") else None)
        if fields["method"] in UNOFFERED_SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method={fields['method']!r} is not supported: "
                f"{UNOFFERED_SPECULATIVE_METHODS[fields['method']]}; use 'ngram', a draft "
                "model ('model') or, on Qwen3.5 / Qwen3-Next checkpoints, 'mtp'")
        if fields["method"] not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method={fields['method']!r} is not supported: expected one "
                "of "
                f"{', '.join(SPECULATIVE_METHODS)} (or a 'model' for a draft model)")
        if fields["method"] == "ngram":
            lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
            lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo,
                                                               lo if hi is None else hi)
            fields["prompt_lookup_min"], fields["prompt_lookup_max"] = lo, hi
        return cls(**fields)

    def __post_init__(self):
        for name in ("num_speculative_tokens", "disable_by_batch_size", "prompt_lookup_min",
                     "prompt_lookup_max", "draft_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or
                                      value < 1):
                raise ValueError(
                    f"speculative_config: {name} must be a positive int, got {value!r}")
        if self.method == "ngram":
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} is above "
                    f"prompt_lookup_max={self.prompt_lookup_max}")
            if self.model is not None:
                raise ValueError("speculative_config: method='ngram' takes no draft 'model'")
        elif self.method == "mtp":
            if self.model is not None:  # vLLM's mtp reads the target's own checkpoint
                raise ValueError("speculative_config: method='mtp' takes no 'model': the MTP head "
                                 "is read from the target's own checkpoint (mtp.*)")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "speculative_config: method='draft_model' needs 'model', the draft's checkpoint")
        if not isinstance(self.adaptive, bool):
            raise ValueError(
                f"speculative_config: adaptive must be true or false, got {self.adaptive!r}")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError(
                f"speculative_config: draft_tensor_parallel_size={self.draft_tensor_parallel_size} "
                "is not "
                "supported: the draft model runs whole on rank 0 (draft_tensor_parallel_size=1)")


def default_batched_tokens(max_model_len: int) -> int:
    """max_num_batched_tokens when none is given."""
    return max(min(max_model_len, DEFAULT_MAX_BATCHED_TOKENS), MIN_BATCHED_TOKENS)


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked for, checked when made and never changed after: engine/sizing.py resolves
    it, the model and the machine into a ResolvedConfig."""
    model: str
    device: str | torch.device = "auto"
    dtype: str | torch.dtype = "auto"
    # None: the model's max_position_embeddings (at most max_model_len_cap), lowered to what the KV
    # cache holds when it holds less (a warning says so), down to MIN_FITTED_MODEL_LEN. A length
    # given here must fit.
    max_model_len: int | None = None
    # with max_model_len=None: use at most this many (the apps' default)
    max_model_len_cap: int | None = None
    max_num_seqs: int = 256
    # Tokens per step. None: default_batched_tokens(max_model_len), i.e. min(max_model_len, 8192),
    # at least 2048; longer prompts prefill in chunks.
    max_num_batched_tokens: int | None = None
    # None: the device's default (its op backend's default_block_size): 16 on CPU, 128 on NPU, 256
    # on CUDA with flash_attn.
    kvcache_block_size: int | None = None
    # Share of memory for weights + activations + KV cache on accelerators; on CPU, of the RAM free
    # after load.
    memory_utilization: float | None = None
    kv_cache_bytes: int | None = None  # exact KV pool size, overriding memory_utilization
    enable_prefix_caching: bool = True
    # Force one op implementation for this engine ("cpu-compiled", "reference", "cuda", "npu");
    # None: $VLINFER_OPS if set, else the device's own kernels. Another engine in the process keeps
    # its own choice.
    ops: str | None = None
    # False: decode steps replay captured graphs where the device has them (CUDA, NPU)
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    # MoE models under tensor parallelism: each rank holds num_experts / tensor_parallel_size whole
    # experts (the others contribute zero there; one all-reduce sums the ranks), instead of every
    # expert sliced along its intermediate dimension. Attention stays tensor-parallel either way.
    enable_expert_parallel: bool = False
    # Where tensor-parallel ranks meet. None: spawned local workers on a port the OS picks (under
    # torchrun, i.e. with RANK / WORLD_SIZE set: env://); "tcp://host:port": there, rank 0 hosts the
    # store; "env://": MASTER_ADDR / MASTER_PORT.
    distributed_init_method: str | None = None
    # a step's collectives: how long a rank may wait for the others
    distributed_timeout_s: float = 60.0
    # workers starting, connecting and loading their shard
    distributed_startup_timeout_s: float = 600.0
    seed: int = 0
    # Weight quantization applied on load to a dense checkpoint: "int8" (weight-only, per output
    # channel) or "int4" (weight-only, groups of 128). None keeps what the checkpoint has (dense, or
    # its own quantization_config).
    quantization: str | None = None
    # Fetch http(s) image URLs: True with vlinfer.multimodal.UrlPolicy's limits (public hosts only),
    # or a UrlPolicy. Off so a request cannot make the engine fetch.
    allow_image_urls: bool = False
    # vLLM's name for which logprobs requests get. Only its default is offered: log_softmax of the
    # raw logits, before grammar masks, penalties and temperature (engine/sampler.py step 0).
    logprobs_mode: str = "raw_logprobs"
    # The dtype K and V are stored in (KV_CACHE_DTYPES): "auto" is the compute dtype; a smaller one
    # holds more tokens in the same budget, at the accuracy README's correctness table states.
    kv_cache_dtype: str = "auto"
    # vLLM's: the dtype a hybrid model's recurrent state is stored in (SSM_CACHE_DTYPES); a 16-bit
    # one holds about twice the sequences in the same budget (docs/hybrid.md states its accuracy).
    mamba_ssm_cache_dtype: str = "auto"
    # vLLM's: a vision-language checkpoint run as its language model alone: the vision tower is not
    # built nor read, and requests with images or videos are refused by name.
    language_model_only: bool = False
    # vLLM's runner: "generate" (sampling), "pooling" (embed / classify / score: prefill only, a
    # vector or a score per request), or "auto": pooling for a classification architecture or a
    # checkpoint without an LM head, else generate (models/registry.py pooling_task).
    runner: str = "auto"
    # vLLM's hf_overrides: config.json fields replaced before the model is built, e.g. a Qwen3-VL
    # reranker's {"architectures": ["Qwen3VLForSequenceClassification"], "classifier_from_token":
    # ["no", "yes"], "is_original_qwen3_reranker": True}.
    hf_overrides: dict | None = None
    # LoRA adapters (vLLM's options): LoRARequest per request; up to max_loras distinct adapters in
    # one step, each of rank <= max_lora_rank, and up to max_cpu_loras (None: max_loras) read and
    # kept on the host.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's speculative_config (SpeculativeConfig's keys), e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}; stored checked,
    # as a SpeculativeConfig. None: no speculation.
    speculative_config: dict | SpeculativeConfig | None = None
    # vLLM's --reasoning-parser: "qwen3" splits `<think> ... </think>` from the answer into each
    # output's `reasoning`; "auto" picks it when the chat template thinks (structured/reasoning.py
    # template_thinks), "none" (or vLLM's None / "") leaves the thinking in the text.
    reasoning_parser: str | None = "auto"

    def __post_init__(self):
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.of(self.speculative_config))
        for name in ("max_num_seqs", "kvcache_block_size", "max_model_len", "max_model_len_cap",
                     "max_num_batched_tokens", "kv_cache_bytes", "tensor_parallel_size",
                     "max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        spec = self.speculative_config
        if spec is not None and spec.method == "mtp" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"speculative_config: method='mtp' with tensor_parallel_size="
                f"{self.tensor_parallel_size} is not supported: the MTP head, its kept hidden "
                "states and a rejection's state put-back run on one rank")
        if self.memory_utilization is not None and not (isinstance(self.memory_utilization,
                                                                   (int, float)) and
                                                        0 < self.memory_utilization <= 1):
            raise ValueError(
                f"memory_utilization must be in (0, 1], got {self.memory_utilization!r}")
        for name in ("distributed_timeout_s", "distributed_startup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value,
                                                         (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.quantization is not None and self.quantization not in ("int8", "int4"):
            raise ValueError(
                f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}"
            )
        if self.logprobs_mode != "raw_logprobs":
            raise ValueError(
                f"logprobs_mode={self.logprobs_mode!r} is not supported: vlinfer returns vLLM's "
                "default "
                "'raw_logprobs' only (raw_logits, processed_logprobs and processed_logits are not "
                "offered)"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: expected one of "
                f"{', '.join(KV_CACHE_DTYPE_NAMES)}")
        if self.mamba_ssm_cache_dtype not in SSM_CACHE_DTYPE_NAMES:
            raise ValueError(
                f"mamba_ssm_cache_dtype={self.mamba_ssm_cache_dtype!r} is not supported: expected "
                f"one of {', '.join(SSM_CACHE_DTYPE_NAMES)}")
        if not isinstance(self.language_model_only, bool):
            raise ValueError(
                f"language_model_only must be True or False, got {self.language_model_only!r}")
        if self.runner not in RUNNERS:
            raise ValueError(
                f"runner={self.runner!r} is not supported: expected one of {', '.join(RUNNERS)}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(
                "hf_overrides must be a dict of config.json fields, got "
                f"{type(self.hf_overrides).__name__}"
            )
        if self.reasoning_parser not in (None, "") + REASONING_PARSER_CHOICES:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} is not supported: "
                             f"expected one of {', '.join(REASONING_PARSER_CHOICES)}")
        method = self.distributed_init_method
        if method is not None and not (isinstance(method, str) and method.startswith(INIT_SCHEMES)):
            raise ValueError(
                "distributed_init_method must be None, 'tcp://host:port' or 'env://', got "
                f"{method!r}"
            )


@dataclass(frozen=True)
class ResolvedConfig:
    """What one engine runs with, resolved once from its EngineConfig, the model and the machine
    (engine/sizing.py). Frozen: the scheduler, the model runner, graph capture and the server read
    it, and nothing changes or re-derives a value after."""
    dtype: torch.dtype  # the compute dtype of weights, activations and the KV cache
    max_model_len: int  # the longest sequence (prompt + output) a request may reach
    block_size: int  # tokens per KV block
    max_num_batched_tokens: int  # tokens per engine step
    max_num_seqs: int  # sequences per engine step
    num_blocks: int  # KV blocks in the pool (per rank: each holds its KV heads of every block)
    # one block's K and V over every layer, on one rank, as stored (scales included)
    bytes_per_block: int
    kv_cache_dtype: torch.dtype  # the dtype K and V are stored in
    # a hybrid model's per-sequence state slots (max_num_seqs is capped to them); 0 for none
    num_state_slots: int = 0
    # a hybrid model's prefix-cache state checkpoints, slots of the same size past the live ones
    num_checkpoint_slots: int = 0
    # off for a hybrid model whose budget holds no checkpoint: a hit restores one (sizing.py)
    enable_prefix_caching: bool = True

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size
