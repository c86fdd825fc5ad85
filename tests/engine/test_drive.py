"""engine/drive.py, the one loop that runs requests to their end, on a fake engine: it yields only
its requests' outputs, stops when they have finished (not when the engine is idle), and aborts
those still running however the loop stops early: a failed step, an interrupt in the caller's
body, a generator closed or dropped."""
from types import SimpleNamespace

import pytest

from vlinfer.engine.drive import drive, step


class FakeEngine:
    """Requests that finish after a number of steps; each step outputs one of every request's."""

    def __init__(self, lengths: dict[str, int], fail_at: int | None = None):
        self.left = dict(lengths)
        self.requests = {rid: SimpleNamespace(request_id=rid, parent_id=rid.split("#")[0])
                         for rid in lengths}
        self.aborted, self.steps, self.fail_at = [], 0, fail_at

    def step(self):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("step failed")
        outputs = []
        for rid in list(self.requests):
            self.left[rid] -= 1
            finished = self.left[rid] == 0
            parent = self.requests[rid].parent_id
            outputs.append(SimpleNamespace(request_id=parent, seq=rid, finished=finished))
            if finished:
                del self.requests[rid]
        return outputs

    def abort_request(self, rid: str) -> bool:
        self.aborted.append(rid)
        return self.requests.pop(rid, None) is not None


def test_drive_yields_its_requests_until_they_finish():
    engine = FakeEngine({"a#0": 2, "a#1": 3, "b": 5})
    outs = list(drive(engine, ["a"]))
    assert [o.seq for o in outs] == ["a#0", "a#1", "a#0", "a#1", "a#1"]
    assert engine.steps == 3 and list(engine.requests) == ["b"] and engine.aborted == []


def test_a_failed_step_aborts_the_requests_still_running():
    engine = FakeEngine({"a": 2, "b": 5, "c": 5}, fail_at=3)
    with pytest.raises(RuntimeError, match="step failed"):
        list(drive(engine, ["a", "b"]))
    assert engine.aborted == ["b"] and list(engine.requests) == ["c"]


@pytest.mark.parametrize("stop", ["close", "drop", "interrupt"])
def test_stopping_early_aborts(stop):
    engine = FakeEngine({"a": 5, "b": 5})
    outputs = drive(engine, ["a"])
    if stop == "close":
        next(outputs)
        outputs.close()
    elif stop == "drop":
        next(outputs)
        del outputs
    else:
        with pytest.raises(KeyboardInterrupt):
            for _ in outputs:
                raise KeyboardInterrupt
        del outputs
    assert engine.aborted == ["a"] and list(engine.requests) == ["b"]


def test_step_aborts_what_it_is_given_when_the_step_fails():
    engine = FakeEngine({"a": 5, "b": 5}, fail_at=1)
    with pytest.raises(RuntimeError):
        step(engine, engine.requests)  # read only on failure, copied before aborting
    assert engine.aborted == ["a", "b"] and not engine.requests
