"""The one place an engine's context length and KV cache are sized: the user's EngineConfig, the
model's length and the machine's memory in, a frozen ResolvedConfig out.

Three calls, in the order the engine can answer them: `context_limit` before any weight is read (a
max_model_len the model cannot run fails at once), `block_size` before the model runner is built,
and `resolve` once the model is loaded and its cache pool (engine/cache_pool.py) says what a KV
block and a state slot cost."""
import logging
import math
import numbers

import torch

from vlinfer import ops, platform
from vlinfer.config import (ACCELERATOR_DEFAULT_MEMORY_UTILIZATION, CPU_DEFAULT_MEMORY_UTILIZATION,
                            KV_CACHE_DTYPES, MIN_FITTED_MODEL_LEN, SSM_CACHE_DTYPES, EngineConfig,
                            ResolvedConfig, default_batched_tokens)
from vlinfer.layers.quantization import kv_cache
from vlinfer.models import get_model_class
from vlinfer.models.interfaces import HasStateSlots

logger = logging.getLogger("vlinfer")
DEFAULT_MODEL_LEN = 4096  # for a config without max_position_embeddings


def context_limit(config: EngineConfig, text_config) -> tuple[int, int]:
    """(the model's own length, the longest max_model_len this engine may run). With max_model_len
    unset the longest is the model's length (at most max_model_len_cap); `resolve` may fit it down
    to the KV pool."""
    declared = getattr(text_config, "max_position_embeddings", None)
    if declared is not None and not (isinstance(declared, numbers.Integral) and declared >= 1):
        raise ValueError(
            f"{config.model}: the checkpoint's max_position_embeddings={declared!r} is not a "
            "positive "
            "length (a damaged config or GGUF context_length)")
    model_len = declared or DEFAULT_MODEL_LEN
    if config.max_model_len is not None and config.max_model_len > model_len:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={model_len} ({config.model})")
    return model_len, config.max_model_len or min(model_len, config.max_model_len_cap or model_len)


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, hf_config,
                   folder: str | None) -> torch.dtype:
    """The dtype K and V are stored in: kv_cache_dtype's; for "auto", the checkpoint's KV scheme's
    (layers/quantization/kv_cache.py), else the compute dtype. A checkpoint's scales serve only its
    own dtype."""
    requested = KV_CACHE_DTYPES[config.kv_cache_dtype]
    scheme = kv_cache.detect_kv_cache_scheme(hf_config, folder)
    if scheme is None:
        return requested or dtype
    if requested is None or requested == scheme.cache_dtype:
        logger.info("KV cache: %s (kv_cache_dtype=%s)", scheme.describe(), config.kv_cache_dtype)
        return scheme.cache_dtype
    logger.warning(
        "KV cache: kv_cache_dtype=%s overrides the checkpoint's KV scheme (%s); its scales are not "
        "used",
        config.kv_cache_dtype, scheme.describe())
    return requested


def state_dtype(config: EngineConfig, hf_config, device: torch.device) -> torch.dtype:
    """The dtype a hybrid model's recurrent state is stored in (mamba_ssm_cache_dtype), or a clear
    error where the device cannot keep it; float32 (unused) for a model without state slots."""
    dtype = SSM_CACHE_DTYPES[config.mamba_ssm_cache_dtype]
    if not issubclass(get_model_class(hf_config), HasStateSlots):
        return torch.float32
    if not platform.holds_dtype(dtype, device):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"mamba_ssm_cache_dtype={config.mamba_ssm_cache_dtype}: this {device.type} device has "
            f"no native {name} (on a CPU: {name} instructions, e.g. AVX512-BF16 / AVX512-FP16 or "
            "AMX); use float32 (auto) or a dtype it has")
    return dtype


def block_size(config: EngineConfig, device) -> int:
    return config.kvcache_block_size or ops.default_block_size(device.type)


def resolve(config: EngineConfig, dtype, model_len: int, longest: int, block_size: int, runner,
            ranks_per_host: int = 1, draft=None) -> ResolvedConfig:
    """Size the KV pool for `runner` (its cache pool's bytes per block and per state slot, its
    dummy blocks, a profiled step on accelerators) and, with max_model_len unset, fit the context
    length to what the pool holds. ranks_per_host: tensor-parallel ranks sharing this host's RAM
    (each holds its heads of every block). draft: a speculative draft model, whose pool has as
    many blocks as the target's, from the same budget."""
    pool = runner.cache_pool
    batched = config.max_num_batched_tokens or default_batched_tokens(longest)
    draft_bytes = draft.bytes_per_block if draft is not None else 0
    budget = _budget(config, min(batched, longest), runner, ranks_per_host)
    num_slots = _num_state_slots(config, longest, block_size, pool, budget)
    num_checkpoints = _num_checkpoint_slots(config, longest, block_size, pool, num_slots,
                                            budget - num_slots * pool.bytes_per_slot)
    num_blocks = _num_blocks(config, longest, block_size, pool, budget - (
        num_slots + num_checkpoints) * pool.bytes_per_slot, draft_bytes)
    max_model_len = longest
    per_rank = " per rank" if config.tensor_parallel_size > 1 else ""
    if config.max_model_len is None:
        max_model_len = _fitted_len(config, model_len, longest, num_blocks, block_size,
                                    pool.bytes_per_block, per_rank)
        # the fitted length may be shorter than the step budget
        if config.max_num_batched_tokens is None:
            batched = default_batched_tokens(max_model_len)
    resolved = ResolvedConfig(dtype=dtype, max_model_len=max_model_len, block_size=block_size,
                              max_num_batched_tokens=batched,
                              max_num_seqs=num_slots or config.max_num_seqs,
                              num_blocks=num_blocks, bytes_per_block=pool.bytes_per_block,
                              kv_cache_dtype=pool.dtype, num_state_slots=num_slots,
                              num_checkpoint_slots=num_checkpoints,
                              enable_prefix_caching=config.enable_prefix_caching and (
                                  not num_slots or num_checkpoints > 0))
    logger.info("KV cache: %s; max_model_len=%d, %d tokens per step",
                pool.capacity(num_blocks, per_rank), max_model_len, batched)
    if num_slots:
        logger.info("state cache: %s; max_num_seqs=%d",
                    pool.slot_capacity(num_slots, per_rank, num_checkpoints), num_slots)
        if config.enable_prefix_caching and not num_checkpoints:
            logger.warning("prefix caching: off for this hybrid model: the KV cache budget holds "
                           "no state checkpoint beside one sequence's KV blocks (a hit restores "
                           "one); raise kv_cache_bytes / memory_utilization")
    return resolved


def _one_sequence_kv_bytes(config: EngineConfig, longest: int, block_size: int, pool) -> int:
    """The KV blocks of one sequence, which the state slots and checkpoints leave room for: of
    max_model_len where given, else of the shortest length fitted."""
    shortest = longest if config.max_model_len is not None else min(longest, MIN_FITTED_MODEL_LEN)
    return math.ceil(shortest / block_size) * pool.bytes_per_block


def _num_state_slots(config: EngineConfig, longest: int, block_size: int, pool,
                     budget: float) -> int:
    """A hybrid model's state slots: one per sequence the scheduler may run (max_num_seqs), capped
    so the budget keeps room for one sequence's KV blocks; 0 for a pure-attention model."""
    if not pool.bytes_per_slot:
        return 0
    one_seq = _one_sequence_kv_bytes(config, longest, block_size, pool)
    slots = min(config.max_num_seqs, int((budget - one_seq) // pool.bytes_per_slot))
    if slots < 1:
        raise ValueError(
            f"KV cache budget of {int(budget)} bytes cannot hold one sequence's state "
            f"({pool.bytes_per_slot} bytes a state slot) and its KV blocks; raise kv_cache_bytes / "
            "memory_utilization")
    if slots < config.max_num_seqs:
        logger.warning("max_num_seqs=%d capped to %d: the state slots the budget holds",
                       config.max_num_seqs, slots)
    return slots


def _num_checkpoint_slots(config: EngineConfig, longest: int, block_size: int, pool,
                          num_slots: int, budget: float) -> int:
    """A hybrid model's prefix-cache checkpoints (docs/hybrid.md "Prefix caching"), each a state
    slot's bytes: one per live slot, from at most half of what the live slots leave beside one
    sequence's KV blocks, so the KV pool keeps the larger share; 0 without prefix caching."""
    if not pool.bytes_per_slot or not config.enable_prefix_caching:
        return 0
    spare = budget - _one_sequence_kv_bytes(config, longest, block_size, pool)
    return max(0, min(num_slots, int(spare / 2 // pool.bytes_per_slot)))


def _budget(config: EngineConfig, batched: int, runner, ranks_per_host: int) -> float:
    """Bytes for the cache pool on this rank."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if runner.device.type == "cpu":
        fraction = config.memory_utilization or CPU_DEFAULT_MEMORY_UTILIZATION
        return fraction * platform.available_memory(runner.device) / ranks_per_host
    peak = runner.profile_peak_memory(batched)
    fraction = config.memory_utilization or ACCELERATOR_DEFAULT_MEMORY_UTILIZATION
    return fraction * platform.total_memory(runner.device) - peak


def _num_blocks(config: EngineConfig, longest: int, block_size: int, pool, budget: float,
                draft_bytes_per_block: int) -> int:
    """KV blocks in the pool. With max_model_len given, the pool must hold one sequence of that
    length. Without, the pool may hold less than `longest`, down to MIN_FITTED_MODEL_LEN tokens.
    State slots (one per sequence the scheduler may run) come out of the budget first."""
    per_seq = math.ceil(longest / block_size)
    # more blocks than every sequence at full length is waste
    useful = config.max_num_seqs * per_seq
    per_block = pool.bytes_per_block + draft_bytes_per_block
    num_blocks = max(0, min(int(budget // per_block) - pool.num_dummy_blocks, useful))
    holds = (f"KV cache budget of {int(budget)} bytes holds {num_blocks} blocks of {block_size} "
             "tokens")
    if config.max_model_len is not None and num_blocks < per_seq:
        raise ValueError(
            f"{holds}, fewer than one sequence of max_model_len={longest} needs ({per_seq}); "
            "raise kv_cache_bytes / memory_utilization, lower max_model_len, or leave it unset to "
            "fit it to the KV cache")
    shortest = min(longest, MIN_FITTED_MODEL_LEN)
    if config.max_model_len is None and num_blocks * block_size < shortest:
        raise ValueError(
            f"{holds}, fewer than {shortest} tokens, the shortest max_model_len vlinfer fits to "
            "the "
            f"KV cache; raise kv_cache_bytes / memory_utilization")
    return num_blocks


def _fitted_len(config: EngineConfig, model_len: int, longest: int, num_blocks: int,
                block_size: int, bytes_per_block: int, per_rank: str) -> int:
    """No max_model_len was given: the longest length allowed, or, if the KV pool holds fewer
    tokens, the longest sequence the pool holds, in whole blocks (a warning says so)."""
    allowed = f"the model's max_position_embeddings={model_len}"
    if longest < model_len:
        allowed = f"max_model_len_cap={config.max_model_len_cap}; the model allows {model_len}"
    pool_tokens = num_blocks * block_size
    if pool_tokens >= longest:
        logger.info("max_model_len=%d (%s)", longest, allowed)
        return longest
    logger.warning(
        "max_model_len=%d: the KV cache (%d blocks of %d tokens, %.1f MiB%s) holds fewer tokens "
        "than "
        "%s, so the context length is fitted to it. To raise it, raise kv_cache_bytes or "
        "memory_utilization; a max_model_len you pass is used as is, and must fit", pool_tokens,
        num_blocks, block_size, num_blocks * bytes_per_block / 2**20, per_rank, allowed)
    return pool_tokens
