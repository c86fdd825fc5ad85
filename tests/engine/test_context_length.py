"""max_model_len: left unset, the model's own length, fitted to the KV cache when the cache holds
less (Qwen3-VL declares 262144 positions); given, used as is and refused when it does not fit.
Through LLM and Pipeline here; the CLI, the server and the demo in their own test files."""
import json
import logging
import shutil

import pytest
from images import picture

from vlinfer import LLM, Pipeline, SamplingParams
from vlinfer.config import DEFAULT_MAX_BATCHED_TOKENS

# The tiny Qwen3-VL's KV cache in float32: 2 layers x 2 KV heads x head_dim 32 x (K, V) x 4 bytes
# per token.
KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 2 * 4
FITTED = 3072  # tokens the pool below holds: a multiple of the block size (16)
POOL = FITTED * KV_BYTES_PER_TOKEN
ENGINE = dict(dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def long_context(tiny_vl_with_context):
    return tiny_vl_with_context(262144)


def test_unset_max_model_len_is_fitted_to_the_kv_cache(long_context, caplog):
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        llm = LLM(long_context, kv_cache_bytes=POOL, **ENGINE)
    engine = llm.engine
    assert engine.max_model_len == FITTED
    assert engine.block_manager.num_blocks * engine.resolved.block_size == FITTED
    # follows the fitted length, not 262144
    assert engine.scheduler.max_num_batched_tokens == FITTED
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"max_model_len={FITTED}" in warning and "max_position_embeddings=262144" in warning
    assert "kv_cache_bytes" in warning and "memory_utilization" in warning \
        and "max_model_len" in warning
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=f"more than max_model_len={FITTED}"):
        llm.generate([[5] * (FITTED + 1)], use_tqdm=False)


def test_a_fitted_length_bounds_the_step_not_the_prompt(long_context):
    """A pool holding more than DEFAULT_MAX_BATCHED_TOKENS: the step budget stays bounded (prompts
    longer than it prefill in chunks, as tests/engine/test_scheduler.py checks), so the
    accelerators' memory profile, which runs before the length is known, stays small."""
    fitted = 2 * DEFAULT_MAX_BATCHED_TOKENS
    llm = LLM(long_context, kv_cache_bytes=fitted * KV_BYTES_PER_TOKEN, **ENGINE)
    assert llm.engine.max_model_len == fitted
    assert llm.engine.scheduler.max_num_batched_tokens == DEFAULT_MAX_BATCHED_TOKENS


def test_max_model_len_cap_bounds_the_unset_length(long_context, caplog):
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        llm = LLM(long_context, kv_cache_bytes=POOL, max_model_len_cap=1024, **ENGINE)
    assert llm.engine.max_model_len == 1024
    # the pool holds the capped length
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert llm.engine.scheduler.max_num_batched_tokens == 2048


def test_a_given_max_model_len_must_fit(long_context):
    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len=8192 needs"):
        LLM(long_context, kv_cache_bytes=POOL, max_model_len=8192, **ENGINE)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=262144"):
        LLM(long_context, kv_cache_bytes=POOL, max_model_len=262145, **ENGINE)
    llm = LLM(long_context, kv_cache_bytes=POOL, max_model_len=1000, **ENGINE)
    assert llm.engine.max_model_len == 1000


def test_a_pool_too_small_for_a_useful_context_is_an_error(long_context):
    with pytest.raises(ValueError,
                       match="fewer than 2048 tokens, the shortest max_model_len vlinfer fits"):
        LLM(long_context, kv_cache_bytes=1024 * KV_BYTES_PER_TOKEN, **ENGINE)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8192"])
def test_bad_max_model_len_cap(long_context, bad):
    with pytest.raises(ValueError, match="max_model_len_cap must be a positive int"):
        LLM(long_context, max_model_len_cap=bad, **ENGINE)


def test_pipeline_on_a_262144_position_checkpoint(long_context):
    pipe = Pipeline(long_context, kv_cache_bytes=POOL, **ENGINE)
    assert pipe.engine.max_model_len == FITTED
    image = picture(64, 64, seed=0)
    answer = pipe(image, "What is in this picture?", max_tokens=4, temperature=0)
    # The fitted engine answers as one given a short length explicitly: the fit changes the bounds,
    # not the model.
    short = LLM(long_context, kv_cache_bytes=POOL, max_model_len=1024, **ENGINE)
    ref = short.chat(pipe.messages("What is in this picture?", [image]),
                     SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert answer == ref.text and (len(ref.token_ids) == 4 or ref.finish_reason == "stop")


def test_resolved_sizing_is_frozen_and_read_by_every_part(long_context):
    """The context length and KV sizing are resolved once (engine/sizing.py) into a frozen
    ResolvedConfig; the user's EngineConfig is left as given (max_model_len still unset), and
    nothing can change either after."""
    import dataclasses
    engine = LLM(long_context, kv_cache_bytes=POOL, **ENGINE).engine
    resolved = engine.resolved
    assert (resolved.max_model_len, resolved.num_blocks, resolved.block_size) == (FITTED,
                                                                                  FITTED // 16, 16)
    assert engine.config.max_model_len is None and engine.config.max_num_batched_tokens is None
    for frozen, field in ((resolved, "max_model_len"), (resolved, "num_blocks"), (engine.config,
                                                                                  "max_model_len")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(frozen, field, 1)
    assert engine.max_model_len == engine.input_processor.max_model_len \
        == engine.output_processor.max_model_len == resolved.max_model_len
    assert engine.block_manager.num_blocks == resolved.num_blocks
    pool = engine.model_runner.cache_pool
    assert pool.kv_cache.shape[2] == resolved.num_blocks + pool.num_dummy_blocks
    assert engine.scheduler.max_num_batched_tokens == resolved.max_num_batched_tokens
    assert engine.model_runner.block_size == engine.block_manager.block_size == resolved.block_size


@pytest.mark.parametrize("length", [0, -4096])
def test_a_checkpoint_without_a_positive_length_is_refused_by_name(long_context, tmp_path, length):
    """A damaged config (or GGUF context_length) declaring no usable length: an error naming the
    checkpoint before any weight is read, not a rotary table of no rows failing inside the first
    step."""
    folder = shutil.copytree(long_context, tmp_path / "damaged")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = length
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError,
                       match=f"max_position_embeddings={length} is not a positive length") as e:
        LLM(str(folder), kv_cache_bytes=POOL, **ENGINE)
    assert str(folder) in str(e.value)
