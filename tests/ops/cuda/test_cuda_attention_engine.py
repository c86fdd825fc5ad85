"""The engine on the CUDA ops without flash_attn (CPU tensors, our Triton attention under the Triton
interpreter: cuda/triton/paged_attention.py) against the reference op table, end to end on a tiny
Qwen3-VL: text, images and a video in one batch, chunked prefill (16-token steps), prefix-cache hits
(the same prompts again); and preemption (a pool too small for the batch, on the text model).
float32: greedy tokens equal. The kernels' launches are counted, so a dispatch that fell back to the
reference fails here. The Qwen3-VL test is in the slow tier (minutes under the interpreter); the
default suite runs the text engine on these ops here, in tests/engine/test_graph_runner.py and
tests/engine/test_lora_graphs.py, and the kernels' grid in tests/ops/cuda/test_cuda_ops.py."""
import collections

import numpy as np
import pytest

from engine_checks import assert_block_pool_empty
from graph_runner_cases import (TEXT_PROMPT, TWO_IMAGES, VL_PROMPT, greedy, picture,  # noqa: F401
                               vl_checkpoint)
from vlinfer import LLM

VIDEO_PROMPT = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens?" \
               "<|im_end|>\n<|im_start|>assistant\n"
REQUESTS = [{"prompt": VL_PROMPT, "multi_modal_data": {"image": [picture(96, 128, 1)]}},
            TEXT_PROMPT, {
                "prompt": TWO_IMAGES,
                "multi_modal_data": {"image": [picture(64, 64, 2),
                                               picture(160, 96, 3)]}
            }, {
                "prompt": VIDEO_PROMPT, "multi_modal_data": {
                    "video": np.random.default_rng(1).integers(0, 255, (4, 64, 96, 3),
                                                               dtype=np.uint8)
                }
            }]
MAX_TOKENS = [6, 9, 4, 7]


def generate(llm, cached: list | None = None):
    """Greedy tokens per request; cached (a list) gets each request's prefix-cache hit, in tokens.
    """
    outs = llm.generate(REQUESTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    if cached is not None:
        cached.extend(o.num_cached_tokens for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def interpreted(monkeypatch):
    import sys
    import triton  # noqa: F401  (a test dependency: a missing one fails here)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "flash_attn", None)


def count_launches(monkeypatch, ops) -> collections.Counter:
    """Calls of our Triton attention's entry points on this engine's op table."""
    calls = collections.Counter()
    module = ops._attention
    for name in ("paged_attention", "varlen_attention"):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name,
            lambda *a, real=real, name=name, **k: calls.update([name]) or real(*a, **k))
    return calls


@pytest.mark.slow  # the interpreter runs every layer's attention of every step: minutes
def test_engine_on_triton_attention_equals_the_reference(interpreted, vl_checkpoint,
                                                         monkeypatch):  # noqa: F811
    """Images and a video with chunked prefill (16-token steps: every image over several steps),
    then the same requests again (their prompts' blocks from the prefix cache)."""
    kw = dict(dtype="float32", max_num_seqs=4, kv_cache_bytes=4 * 2**20, max_model_len=512,
              enforce_eager=True, device="cpu", kvcache_block_size=16, max_num_batched_tokens=16)
    expected = generate(LLM(vl_checkpoint, ops="reference", **kw))
    llm = LLM(vl_checkpoint, ops="cuda", **kw)
    ops = llm.engine.model_runner.ctx.ops
    assert ops.features["attention"] == "triton"
    calls = count_launches(monkeypatch, ops)
    assert generate(llm) == expected
    # text and vision attention both ours
    assert calls["paged_attention"] > 0 and calls["varlen_attention"] > 0
    cached = []
    assert generate(llm, cached) == expected
    assert sum(cached) > 0
    assert_block_pool_empty(llm)


def test_text_engine_preempted_on_triton_attention(interpreted, qwen3_checkpoint, monkeypatch):
    """A pool too small for the batch (preemption, recompute) on our kernels: the reference op
    table's tokens."""
    from graph_runner_cases import PROMPTS
    # 15-token prompts in a 3-block pool: three fit, then each needs its second block while
    # decoding.
    prompts = [(p * 15)[:15] for p in PROMPTS]
    kw = dict(dtype="float32", max_num_seqs=6, kv_cache_bytes=24 * 1024, max_model_len=32,
              enforce_eager=True, device="cpu", kvcache_block_size=16)
    params = [greedy(n) for n in (3, 4, 6, 5, 4)]
    expected = [
        o.outputs[0].token_ids for o in LLM(qwen3_checkpoint[0], ops="reference", **kw).generate(
            prompts, params, use_tqdm=False)
    ]
    llm = LLM(qwen3_checkpoint[0], ops="cuda", **kw)
    calls = count_launches(monkeypatch, llm.engine.model_runner.ctx.ops)
    assert [o.outputs[0].token_ids
            for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.scheduler.num_preemptions > 0 and calls["paged_attention"] > 0
    assert_block_pool_empty(llm)
