"""Two engines in one process own their op tables and step state: a Qwen3 engine on the compiled CPU
kernels and a Llama engine on the pure-torch reference, stepped alternately and from two threads at
once, each give exactly the tokens they give alone. (Before engines owned their state, the second
thread died with "attention called outside a model runner step": the other engine's step had cleared
a module-global context.)"""
import threading

import pytest

from text_checkpoints import build_checkpoint, tiny_text_config
from vlinfer import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3], [200, 201, 7, 8, 9, 10, 11], [42] * 20, [1, 2, 3]]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    qwen3, llama = tmp_path_factory.mktemp("iso-qwen3"), tmp_path_factory.mktemp("iso-llama")
    build_checkpoint(str(qwen3), tiny_text_config("qwen3", True), seed=1)
    build_checkpoint(str(llama), tiny_text_config("llama", False), seed=2)
    a = LLM(str(qwen3), dtype="float32", kv_cache_bytes=1 << 22, ops="cpu-compiled")
    b = LLM(str(llama), dtype="float32", kv_cache_bytes=1 << 22, ops="reference")
    alone = {
        name: _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        for name, llm in (("a", a), ("b", b))
    }
    return a, b, alone


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def test_each_engine_holds_its_own_op_table(engines):
    a, b, _ = engines
    ctx_a, ctx_b = a.engine.model_runner.ctx, b.engine.model_runner.ctx
    assert ctx_a is not ctx_b and ctx_a.ops is not ctx_b.ops
    assert (ctx_a.ops.name, ctx_b.ops.name) == ("cpu-compiled", "reference")
    assert ctx_a.step is None and ctx_b.step is None  # set only while a forward runs


def test_alternate_steps_match_each_engine_alone(engines):
    a, b, alone = engines
    seqs = {}
    for name, llm in (("a", a), ("b", b)):
        seqs[name] = [llm.engine.make_sequence(p, PARAMS) for p in PROMPTS]
        for seq in seqs[name]:
            llm.engine.add_sequence(seq)
    finished = {"a": {}, "b": {}}
    while a.engine.has_unfinished_requests() or b.engine.has_unfinished_requests():
        for name, llm in (("a", a), ("b", b)):  # one step of each, interleaved
            if llm.engine.has_unfinished_requests():
                for out in llm.engine.step():
                    if out.finished:
                        finished[name][out.request_id] = out.outputs[0].token_ids
    for name in ("a", "b"):
        assert [finished[name][seq.request_id] for seq in seqs[name]] == alone[name]


def test_two_threads_match_each_engine_alone(engines):
    a, b, alone = engines
    results, errors = {"a": [], "b": []}, []
    start = threading.Barrier(2)

    def run(name, llm):
        try:
            start.wait()
            for _ in range(3):
                results[name].append(_tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)))
        except BaseException as e:  # reported below: a thread's exception would otherwise vanish
            errors.append(f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=item) for item in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for name in ("a", "b"):
        assert results[name] == [alone[name]] * 3


def test_two_dtypes_built_at_once_from_two_threads(tmp_path, monkeypatch):
    """A bfloat16 and a float32 engine built at the same moment in two threads: every parameter and
    KV block of each is in its own dtype (the dtype travels in ModelContext, never through torch's
    one default dtype per process), the process default is untouched, each counts the checkpoint
    bytes it read itself (a per-load counter, not a process-wide one), and each gives the tokens it
    gives when built alone."""
    import torch

    from vlinfer import loading
    build_checkpoint(str(tmp_path), tiny_text_config("qwen3", True), seed=3)
    options = dict(kv_cache_bytes=1 << 22, ops="reference")
    alone, bytes_read = {}, {}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(str(tmp_path), dtype=dtype, **options)
        alone[dtype] = _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        bytes_read[dtype] = llm.engine.model_runner.checkpoint_bytes_read
    both_built = threading.Barrier(2, timeout=60)
    index = loading.checkpoint_tensor_index

    def index_after_both_built(source, config):  # both engines meet here, mid-build
        both_built.wait()
        return index(source, config)

    monkeypatch.setattr(loading, "checkpoint_tensor_index", index_after_both_built)
    engines, errors = {}, []

    def build(dtype):
        try:
            engines[dtype] = LLM(str(tmp_path), dtype=dtype, **options)
        except BaseException as e:
            errors.append(e)
            both_built.abort()

    threads = [threading.Thread(target=build, args=(dtype,)) for dtype in ("bfloat16", "float32")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.get_default_dtype() == torch.float32
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        engine = engines[name].engine
        assert {p.dtype for p in engine.model_runner.model.parameters()} == {dtype}
        assert engine.model_runner.cache_pool.kv_cache.dtype == dtype == engine.resolved.dtype
        assert engine.model_runner.checkpoint_bytes_read == bytes_read[name] > 0
        assert _tokens(engines[name].generate(PROMPTS, PARAMS, use_tqdm=False)) == alone[name]
