"""What the engine state machines (tests/test_engine_state_machine*.py) share: the rules that abort,
step and drain requests, and the block pool's bookkeeping check. A machine sets self.engine,
self.live (request id -> what it tracks), self.stats, and says in record(out) what a step output
means to it."""
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

DRAIN_STEPS = 400


class EngineRules(RuleBasedStateMachine):
    def record(self, out) -> None:
        """Take one step output (tokens so far, a finished request)."""
        raise NotImplementedError

    def before_step(self) -> None:
        """A check on the engine's state before each step."""

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.engine.abort_request(rid)
        del self.live[rid]
        self.stats["aborted"] += 1

    @rule(steps=st.integers(1, 8))
    def step(self, steps):
        for _ in range(steps):
            self.stats["steps"] += 1
            self.before_step()
            for out in self.engine.step():
                self.record(out)

    @rule()
    def drain(self):
        """Step until every live request has finished (each one's output compared)."""
        for _ in range(DRAIN_STEPS):
            if not self.live:
                return
            self.step(1)
        raise AssertionError(f"{len(self.live)} requests still running after {DRAIN_STEPS} steps")

    def teardown(self):
        """Abort what is still live, let the engine run out, then check_idle()."""
        if not hasattr(self, "engine"):
            return
        for rid in list(self.live):
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():  # nothing is left running
            self.engine.step()
        self.check_idle()

    def check_idle(self) -> None:
        """What must hold once the engine is idle: nothing held."""
        raise NotImplementedError

    def _held(self) -> list[int]:
        return [b.ref_count for b in self.engine.block_manager.blocks]


def completions_done(seen: dict, out, n: int) -> bool:
    """Track a generation request's completions in `seen` (index -> tokens so far); True once all n
    of them finished by length (ignore_eos: the only way they finish)."""
    c = out.outputs[0]
    seen[c.index] = list(c.token_ids)
    if out.finished and c.finish_reason == "length":
        seen.setdefault("finished", set()).add(c.index)
    return len(seen.get("finished", ())) == n


def check_block_pool(manager, seqs) -> None:
    """Each block's reference count is the number of the sequences' tables that hold it, the free
    list is exactly the blocks nobody holds, and every prefix-cache hash names a block that carries
    it."""
    counts = [0] * manager.num_blocks
    for seq in seqs:
        for block in seq.block_table:
            counts[block] += 1
    assert [b.ref_count for b in manager.blocks] == counts
    assert set(manager.free_blocks) == {i for i, c in enumerate(counts) if c == 0}
    assert all(manager.blocks[b].hash == h for h, b in manager.hash_to_block.items())
