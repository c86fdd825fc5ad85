"""EngineLoop: callers submit and abort from their own threads while the loop thread steps the
engine."""
import threading

import pytest

from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.sampling_params import SamplingParams

# only reached when the loop is broken; the assertions are on events, not on how long things took
WAIT_S = 60


class GatedStep:
    """Wraps engine.step: each step announces itself, then waits for the test to let it run."""

    def __init__(self, engine):
        self.step = engine.step
        self.started = threading.Event()
        self.release = threading.Event()
        engine.step = self

    def __call__(self):
        self.started.set()
        # no timeout: a step that gave up waiting would let a blocked submit through
        self.release.wait()
        return self.step()


@pytest.fixture
def gated_loop(qwen3_checkpoint):
    engine = LLMEngine(qwen3_checkpoint[0], dtype="float32", max_model_len=128,
                       kv_cache_bytes=1 << 20)
    gate = GatedStep(engine)
    loop = EngineLoop(engine)
    yield loop, gate
    gate.release.set()
    loop.close()


def call_in_thread(fn):
    """Run fn in a thread; returns (finished event, result holder)."""
    done, result = threading.Event(), {}

    def run():
        result["value"] = fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, result


def test_submit_and_abort_do_not_wait_for_the_step_in_progress(gated_loop):
    loop, gate = gated_loop
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = loop.submit([5, 6, 7], params)
    # the loop thread is now inside a step, which cannot end until released
    assert gate.started.wait(WAIT_S)

    submitted, second = call_in_thread(lambda: loop.submit([8, 9, 10], params))
    assert submitted.wait(WAIT_S), "submit waited for the step in progress"
    aborted, _ = call_in_thread(lambda: loop.abort(first.request_id))
    assert aborted.wait(WAIT_S), "abort waited for the step in progress"
    assert not gate.release.is_set()  # both returned while that step was still held
    assert loop.num_active() == 1  # the aborted request left at once, the new one is queued

    gate.release.set()
    assert list(first) == []  # ended by the abort: no output reached it after the abort
    outputs = list(second["value"])
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    assert loop.num_active() == 0
    loop.close()
    assert loop.engine.block_manager.num_free_blocks == loop.engine.block_manager.num_blocks
    assert not loop.engine.requests


def test_close_ends_queued_streams(gated_loop):
    loop, gate = gated_loop
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    running = loop.submit([5, 6, 7], params)
    assert gate.started.wait(WAIT_S)
    submitted, queued = call_in_thread(lambda: loop.submit([8, 9, 10], params))
    assert submitted.wait(WAIT_S), "submit waited for the step in progress"
    queued = queued["value"]  # still in the inbox when the loop closes
    gate.release.set()
    loop.close()
    for stream in (running, queued):
        list(stream)  # ends (the final output or just the end marker) instead of waiting forever
    assert not loop.engine.requests and not loop.engine.scheduler.has_unfinished()
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit([1, 2], params)
