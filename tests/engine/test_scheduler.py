"""Scheduler: FIFO admission, running-first ordering, token budget and chunked prefill,
max_num_seqs, preemption by recompute, finish/abort, plus SamplingParams validation. Driven by a
fake engine loop, no model."""
import random
from collections import Counter

import pytest

from vlinfer.engine.block_manager import BlockManager
from vlinfer.engine.scheduler import Scheduler
from vlinfer.engine.sequence import Sequence, SequenceStatus
from vlinfer.sampling_params import SamplingParams


def fake_token(seq: Sequence) -> int:
    """What the fake model 'samples': a function of the position, so a recomputed sequence samples
    the same."""
    return 10_000 + seq.num_tokens


class Harness:
    """A scheduler plus the part of LLMEngine.step that matters to it: after each schedule(), every
    scheduled sequence computes its tokens and registers full blocks (Scheduler.update), and samples
    a fake token when its chunk reaches its end; a sequence finishes at max_tokens. Checks the
    scheduler's invariants before and after every step."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                 enable_prefix_caching=True):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens)
        self.seqs: list[Sequence] = []
        # seq_id -> num_new_tokens of every step it was scheduled in
        self.chunks: dict[int, list[int]] = {}
        # in the order they first became RUNNING (re-admissions too)
        self.admitted: list[Sequence] = []
        self.steps = 0

    def add(self, prompt, max_tokens=4) -> Sequence:
        seq = Sequence(list(prompt), SamplingParams(max_tokens=max_tokens))
        self.seqs.append(seq)
        self.chunks[seq.seq_id] = []
        self.sched.add(seq)
        self.check_state()
        return seq

    def step(self):
        s = self.sched
        running_before, waiting_before = list(s.running), list(s.waiting)
        preemptions_before = s.num_preemptions
        out = s.schedule()
        self.steps += 1
        self.check_schedule(out, running_before, waiting_before, preemptions_before)
        self.check_state()
        for seq, n in zip(out.seqs, out.num_new_tokens):
            self.chunks[seq.seq_id].append(n)
            if seq not in running_before:
                self.admitted.append(seq)
        s.update(out, [])  # the engine's way: progress and block caching in one place
        for seq in out.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(fake_token(seq))
                if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                    s.finish(seq)
        self.check_state()
        return out

    def run(self, max_steps=2000, on_step=None):
        outs = []
        while self.sched.has_unfinished():
            assert self.steps < max_steps, "scheduler made no progress"
            out = self.step()
            assert out.seqs, ("nothing scheduled while work is left (pool too small for a single "
                              "request?)")
            outs.append(out)
            if on_step is not None:
                on_step(self, out)
        self.check_done()
        return outs

    # ---- invariants ----
    def check_schedule(self, out, running_before, waiting_before, preemptions_before):
        s, bm = self.sched, self.bm
        assert len(out.seqs) == len(out.num_new_tokens) == len(set(map(id, out.seqs)))
        assert all(n >= 1 for n in out.num_new_tokens)
        assert sum(out.num_new_tokens) <= s.max_num_batched_tokens
        for seq, n in zip(out.seqs, out.num_new_tokens):
            assert seq.status == SequenceStatus.RUNNING and seq in s.running
            assert seq.num_computed_tokens + n <= seq.num_tokens
            assert seq.num_computed_tokens + n <= len(
                seq.block_table) * bm.block_size, "no room for the KV"
        # Running sequences come first, in their order; admissions follow in FIFO order.
        old = [seq for seq in out.seqs if seq in running_before]
        new = [seq for seq in out.seqs if seq not in running_before]
        assert out.seqs == old + new
        assert old == [seq for seq in running_before if seq in old]
        assert new == waiting_before[:len(new)], "admission is not FIFO"
        # A running sequence is skipped only when the budget ran out (or it was preempted).
        skipped = [seq for seq in s.running if seq in running_before and seq not in out.seqs]
        if skipped:
            assert sum(out.num_new_tokens) == s.max_num_batched_tokens
        preempted = [seq for seq in running_before if seq.status == SequenceStatus.WAITING]
        assert s.num_preemptions - preemptions_before == len(preempted)
        if preempted:
            # Victims are the most recently admitted, and go back to the front of waiting in
            # admission order.
            assert preempted == running_before[len(running_before) - len(preempted):]
            assert list(s.waiting)[:len(preempted)] == preempted
            assert not new, "admitted new work in a step that preempted"
            for seq in preempted:
                assert seq.num_computed_tokens == 0 and seq.block_table == [] \
                    and seq.num_preemptions >= 1

    def check_state(self):
        s, bm = self.sched, self.bm
        bs = bm.block_size
        live = s.running + list(s.waiting)
        assert len(live) == len(set(map(id, live)))
        assert len(s.running) <= s.max_num_seqs
        assert all(seq.status == SequenceStatus.RUNNING for seq in s.running)
        for seq in s.waiting:
            assert seq.status == SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in self.seqs:
            if seq.is_finished:
                assert seq.block_table == [] and seq not in live
                continue
            assert seq.num_computed_tokens <= seq.num_tokens
            assert seq.num_computed_tokens <= len(seq.block_table) * bs
            assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens)  # never over-allocated
            assert len(set(seq.block_table)) == len(seq.block_table)
        refs = Counter(b for seq in live for b in seq.block_table)
        assert sum(blk.ref_count for blk in bm.blocks) == sum(len(seq.block_table) for seq in live)
        for blk in bm.blocks:
            assert blk.ref_count == refs[
                blk.block_id], f"block {blk.block_id}: ref_count {blk.ref_count}"
        assert set(bm.free_blocks) == {blk.block_id for blk in bm.blocks if blk.ref_count == 0}
        assert bm.num_free_blocks == bm.num_blocks - len(refs)
        # Each hash names one block, and a hashed block is the one its hash names: an identical copy
        # stays unhashed.
        hashed = [blk for blk in bm.blocks if blk.hash is not None]
        assert len({blk.hash for blk in hashed}) == len(hashed), "two blocks carry the same hash"
        assert all(bm.hash_to_block.get(blk.hash) == blk.block_id for blk in hashed)
        assert all(bm.blocks[b].hash == h for h, b in bm.hash_to_block.items())
        # A block in two sequences is a cached prefix block at the same position of both, whose hash
        # both agree on, and it never holds a holder's last token (that one's KV is always written
        # to a private block).
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in live:
            for i, b in enumerate(seq.block_table):
                holders.setdefault(b, []).append((seq, i))
        for b, hs in holders.items():
            if len(hs) > 1:
                blk = bm.blocks[b]
                assert bm.enable_prefix_caching and blk.hash is not None and blk.ref_count > 1
                assert len({i for _, i in hs}) == 1, f"block {b} at different positions"
                i = hs[0][1]
                assert all((i + 1) * bs < seq.num_tokens and seq.block_hashes[i] == blk.hash
                           for seq, _ in hs)

    def check_done(self):
        s, bm = self.sched, self.bm
        assert not s.running and not s.waiting
        assert bm.num_free_blocks == bm.num_blocks
        assert all(blk.ref_count == 0 for blk in bm.blocks)
        for seq in self.seqs:
            assert seq.is_finished and seq.block_table == []
            if seq.finish_reason != "abort":
                assert seq.num_output_tokens == seq.sampling_params.max_tokens
                # Recompute after preemption must not change what was generated.
                assert seq.output_token_ids == [10_000 + n for n in range(seq.num_prompt_tokens,
                                                                          seq.num_tokens)]


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 30_000) for _ in range(n)]


both_caching = pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "noprefix"])


# --------------------------------------------------------------------------------------------------
# ordering

@both_caching
def test_fifo_admission_under_max_num_seqs(prefix):
    h = Harness(max_num_seqs=2, enable_prefix_caching=prefix)
    a, b, c, d = (h.add(prompt(5, i), max_tokens=2 + i) for i in range(4))
    out = h.step()
    assert out.seqs == [a, b] and out.num_new_tokens == [5, 5]
    assert list(h.sched.waiting) == [c, d]
    h.run()
    assert h.admitted == [a, b, c, d]


@both_caching
def test_fifo_head_of_line_blocks_smaller_requests_behind_it(prefix):
    h = Harness(num_blocks=3, block_size=4, enable_prefix_caching=prefix)
    x = h.add(prompt(8, 1), max_tokens=3)  # 2 blocks
    y = h.add(prompt(8, 2), max_tokens=1)  # needs 2 blocks, only 1 left
    z = h.add(prompt(1, 3), max_tokens=1)  # would fit, but must not overtake y
    out = h.step()
    assert out.seqs == [x]
    assert list(h.sched.waiting) == [y, z]
    assert y.block_table == [] and y.num_computed_tokens == 0
    h.run()
    assert h.admitted == [x, y, z]


def test_running_sequences_are_scheduled_before_waiting_ones():
    h = Harness()
    a = h.add(prompt(6, 1), max_tokens=5)
    h.step()
    b = h.add(prompt(9, 2), max_tokens=2)
    out = h.step()
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 9]
    h.run()


def test_decodes_get_one_token_each():
    h = Harness()
    seqs = [h.add(prompt(n, n), max_tokens=4) for n in (5, 9, 3)]
    out = h.step()
    assert out.seqs == seqs and out.num_new_tokens == [5, 9, 3]
    for _ in range(3):
        out = h.step()
        assert out.seqs == seqs and out.num_new_tokens == [1, 1, 1]
    assert all(seq.is_finished for seq in seqs)
    h.check_done()


# -------------------------------------------------------------------------------------------------
# budgets

@both_caching
def test_long_prompt_is_chunked_by_max_num_batched_tokens(prefix):
    h = Harness(num_blocks=20, block_size=4, max_num_batched_tokens=16,
                enable_prefix_caching=prefix)
    seq = h.add(prompt(50, 7), max_tokens=3)
    computed = []
    while not seq.is_finished:
        before = seq.num_tokens
        h.step()
        computed.append(seq.num_computed_tokens)
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            assert seq.num_tokens == before, "sampled before the prompt was done"
            assert len(seq.block_table) == h.bm.blocks_needed(seq.num_computed_tokens)
    assert h.chunks[seq.seq_id] == [16, 16, 16, 2, 1, 1]
    assert sum(h.chunks[seq.seq_id][:4]) == 50
    assert computed == [16, 32, 48, 50, 51, 52]
    h.check_done()


def test_budget_is_shared_between_sequences_in_one_step():
    h = Harness(max_num_batched_tokens=10)
    a, b = h.add(prompt(6, 1), max_tokens=3), h.add(prompt(6, 2), max_tokens=3)
    out = h.step()
    assert out.seqs == [a, b] and out.num_new_tokens == [6, 4]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    out = h.step()
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 2]
    out = h.step()
    assert out.num_new_tokens == [1, 1]
    h.run()


def test_budget_exhausted_by_running_prefill_admits_nothing():
    h = Harness(max_num_batched_tokens=8)
    a = h.add(prompt(20, 1), max_tokens=1)
    b = h.add(prompt(3, 2), max_tokens=1)
    out = h.step()
    assert out.seqs == [a] and out.num_new_tokens == [8]
    out = h.step()
    assert out.seqs == [a] and out.num_new_tokens == [8]
    out = h.step()
    assert out.seqs == [a, b] and out.num_new_tokens == [4, 3]
    h.check_done()


def test_decodes_and_a_chunked_prefill_share_the_budget():
    h = Harness(max_num_batched_tokens=12)
    decoders = [h.add(prompt(4, i), max_tokens=8) for i in range(3)]
    h.step()
    long = h.add(prompt(30, 9), max_tokens=2)
    out = h.step()
    assert out.seqs == decoders + [long] and out.num_new_tokens == [1, 1, 1, 9]
    out = h.step()
    assert out.num_new_tokens == [1, 1, 1, 9]
    h.run()


@both_caching
def test_max_num_seqs_caps_the_running_set(prefix):
    h = Harness(max_num_seqs=2, enable_prefix_caching=prefix)
    for i in range(5):
        h.add(prompt(3 + i, i), max_tokens=3)
    peak = []
    h.run(on_step=lambda hh, out: peak.append((len(hh.sched.running), len(hh.sched.waiting))))
    assert max(r for r, _ in peak) == 2
    assert any(r == 2 and w > 0 for r, w in peak)  # full while others waited


# -------------------------------------------------------------------------------------- proposals

def test_update_keeps_accepted_proposals_and_rolls_back_the_rest():
    """Speculative decoding's bookkeeping, all in the scheduler: proposals are placed within the
    step's budget in free blocks; update advances progress over every verified row, then rolls the
    rejected ones back (their slots and the blocks past the sequence's tokens), clears them."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, 4, 12)
    seq = Sequence(list(range(1, 8)), SamplingParams(max_tokens=20))
    sched.add(seq)
    out = sched.schedule()
    sched.update(out, [])
    seq.append_token(50)  # 8 tokens, the first 7 computed: a decode
    out = sched.schedule()
    assert out.num_new_tokens == [1]
    sched.add_proposals(out, [(0, [51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62])])
    assert seq.spec_token_ids == list(range(51, 62))  # cut to the 12-token budget
    assert out.num_new_tokens == [12] and len(seq.block_table) == 5  # room for 7 + 12 tokens
    seq.append_token(51)
    seq.append_token(52)
    seq.append_token(9)  # two proposals accepted, then the target's own token
    sched.update(out, [(seq, [51, 52, 9], [None] * 3)])
    assert seq.num_computed_tokens == 10 and seq.num_tokens == 11  # the last one's KV: next step
    assert seq.spec_token_ids == [] and len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert [bm.blocks[b].hash is not None for b in seq.block_table] == [True, True, False]
    sched.finish(seq)
    assert bm.num_free_blocks == 8


def test_proposals_never_preempt():
    bm = BlockManager(2, 4)
    sched = Scheduler(bm, 4, 64)
    seq = Sequence([1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=20))
    sched.add(seq)
    sched.update(sched.schedule(), [])
    seq.append_token(8)
    out = sched.schedule()
    sched.add_proposals(out, [(0, [9, 10])])  # 10 tokens would need a third block
    assert seq.spec_token_ids == [] and out.num_new_tokens == [1] and len(seq.block_table) == 2


# ------------------------------------------------------------------------------------------------
# preemption

@both_caching
def test_preemption_recomputes_the_most_recently_admitted(prefix):
    # 4 blocks of 4: two sequences of prompt 4 grow to 2 blocks each; the first to need a 3rd evicts
    # the other.
    h = Harness(num_blocks=4, block_size=4, enable_prefix_caching=prefix)
    a, b = h.add(prompt(4, 1), max_tokens=8), h.add(prompt(4, 2), max_tokens=8)
    out = h.step()
    assert out.seqs == [a, b] and out.num_new_tokens == [4, 4]
    preempt_step = None
    while not b.num_preemptions:
        out = h.step()
        preempt_step = out
    assert a.num_computed_tokens == 9 and len(a.block_table) == 3
    assert b.status == SequenceStatus.WAITING and h.sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.num_preemptions == 1
    assert h.sched.num_preemptions == 1
    assert b not in preempt_step.seqs and preempt_step.seqs == [a]
    cached_at_first_admission = b.num_cached_tokens
    h.run()
    assert b.is_finished and b.num_output_tokens == 8 and a.num_output_tokens == 8
    assert b.num_cached_tokens == cached_at_first_admission  # counts the first admission only
    assert a.num_preemptions == 0


def test_no_admission_in_a_step_that_preempted():
    # Budget 5: after a's decode 4 tokens are left, and the victim's freed blocks could take a
    # 4-token chunk.
    h = Harness(num_blocks=4, block_size=4, max_num_batched_tokens=5, enable_prefix_caching=False)
    a, b = h.add(prompt(4, 1), max_tokens=8), h.add(prompt(4, 2), max_tokens=8)
    while not b.num_preemptions:
        out = h.step()
    assert out.seqs == [a] and out.num_new_tokens == [1]
    head = h.sched.waiting[0]
    assert head is b
    left = h.sched.max_num_batched_tokens - sum(out.num_new_tokens)
    # The admission loop would have placed b's first chunk: budget, blocks and seats were all there.
    assert left > 0 and h.bm.can_allocate(b, min(b.num_tokens, left))
    assert len(h.sched.running) < h.sched.max_num_seqs
    out = h.step()
    assert out.seqs == [a, b]  # admitted the step after
    h.run()


@both_caching
def test_several_victims_in_one_step_go_back_in_admission_order(prefix):
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=prefix)
    a = h.add(prompt(4, 1), max_tokens=2)
    b = h.add(prompt(4, 2), max_tokens=3)
    c = h.add(prompt(4, 3), max_tokens=3)
    h.step()  # each holds 1 block, 5 free
    # a's prompt grows (say, a tool result spliced in): 31 tokens need 8 blocks at once, 7 more than
    # it has.
    a.token_ids.extend(prompt(26, 4))
    a.num_prompt_tokens = a.num_tokens
    out = h.step()
    assert out.seqs == [a] and out.num_new_tokens == [27]
    assert h.sched.num_preemptions == 2 and b.num_preemptions == c.num_preemptions == 1
    # c (admitted last) was preempted first, but b stays ahead of it
    assert list(h.sched.waiting) == [b, c]
    h.run()
    assert h.admitted[-2:] == [b, c]


@both_caching
def test_a_sequence_too_big_for_the_pool_preempts_itself(prefix):
    h = Harness(num_blocks=2, block_size=4, enable_prefix_caching=prefix)
    a = h.add(prompt(4, 1), max_tokens=8)  # would need 3 blocks at 9 tokens
    for _ in range(5):
        assert h.step().seqs == [a]
    out = h.step()
    assert out.seqs == [] and a.num_preemptions == 1 and list(h.sched.waiting) == [a]
    out = h.step()  # cannot be placed again: the engine raises on an empty batch with work waiting
    assert out.seqs == [] and list(h.sched.waiting) == [a]
    assert h.bm.num_free_blocks == h.bm.num_blocks
    h.sched.finish(a)
    assert h.bm.num_free_blocks == h.bm.num_blocks and not h.sched.has_unfinished()


# ------------------------------------------------------------------------------------------ prefix
# caching

def test_prefix_cache_hit_through_the_scheduler():
    h = Harness(block_size=16)
    p = prompt(40, 5)
    a = h.add(p, max_tokens=2)
    h.run()
    assert a.num_cached_tokens == 0
    b = h.add(p, max_tokens=2)
    out = h.step()
    assert out.num_new_tokens == [8] and b.num_cached_tokens == 32
    h.run()


def test_identical_prompts_in_one_step_do_not_share_uncomputed_blocks():
    h = Harness(block_size=4)
    p = prompt(12, 6)
    a, b = h.add(p, max_tokens=4), h.add(p, max_tokens=4)
    out = h.step()
    assert out.num_new_tokens == [12, 12] and not set(a.block_table) & set(b.block_table)
    # The first holder registered the hashes; b's identical blocks stay unhashed rather than shadow
    # copies.
    assert [h.bm.blocks[x].hash for x in a.block_table] == a.block_hashes[:3]
    assert all(h.bm.blocks[x].hash is None for x in b.block_table)
    c = h.add(p, max_tokens=2)
    out = h.step()
    # Same 12 tokens: the block holding the last token is recomputed, into a block of c's own.
    assert out.seqs[-1] is c and out.num_new_tokens[-1] == 4 and c.num_cached_tokens == 8
    assert c.block_table[:2] == a.block_table[:2]
    assert c.block_table[2] not in a.block_table + b.block_table
    d = h.add(p + [7], max_tokens=2)
    out = h.step()
    # all 3 full blocks cached: only the last token
    assert out.seqs[-1] is d and out.num_new_tokens[-1] == 1
    assert d.num_cached_tokens == 12 and d.block_table[:3] == a.block_table[:3]
    assert not set(d.block_table) & set(b.block_table)
    h.run()


# -------------------------------------------------------------------------------------------------
# finish

@both_caching
def test_finish_frees_running_and_waiting_sequences(prefix):
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=1, max_num_batched_tokens=8,
                enable_prefix_caching=prefix)
    a = h.add(prompt(20, 1), max_tokens=4)
    b = h.add(prompt(6, 2), max_tokens=4)
    h.step()  # a mid-prefill with 2 blocks, b waiting
    assert len(a.block_table) == 2 and a.status == SequenceStatus.RUNNING
    h.sched.finish(a)
    assert a.is_finished and a.block_table == [] and a not in h.sched.running
    h.check_state()
    h.sched.finish(b)
    assert b.is_finished and b not in h.sched.waiting
    h.check_state()
    assert not h.sched.has_unfinished() and h.bm.num_free_blocks == h.bm.num_blocks
    h.sched.finish(a)  # finishing twice is harmless
    assert h.bm.num_free_blocks == h.bm.num_blocks


def test_finish_of_a_sharer_leaves_the_shared_prefix_to_the_other():
    h = Harness(block_size=4)
    p = prompt(12, 3)
    a = h.add(p, max_tokens=6)
    h.step()
    b = h.add(p + [1, 2], max_tokens=6)
    h.step()
    shared = b.block_table[:3]
    assert shared == a.block_table[:3] and all(h.bm.blocks[x].ref_count == 2 for x in shared)
    h.sched.finish(a)
    a.finish_reason = "abort"
    assert all(h.bm.blocks[x].ref_count == 1 for x in shared)
    h.check_state()
    h.run()


# ------------------------------------------------------------------------------------------ random
# workload

@both_caching
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_runs_to_completion_with_invariants(prefix, seed):
    rng = random.Random(seed)
    h = Harness(num_blocks=24, block_size=4, max_num_seqs=rng.choice([2, 4, 8]),
                max_num_batched_tokens=rng.choice([7, 16, 40]), enable_prefix_caching=prefix)
    # a shared prefix: cache hits and shared blocks
    system = prompt(rng.choice([8, 10, 13]), seed + 100)
    pending = []
    for i in range(14):
        p = (system if rng.random() < 0.6 else []) + prompt(rng.randrange(1, 30), seed * 100 + i)
        pending.append((p, rng.randrange(1, 20)))

    def feed(hh, out):
        if pending and rng.random() < 0.5:
            hh.add(*pending.pop())
        live = hh.sched.running + list(hh.sched.waiting)
        if live and rng.random() < 0.05:  # abort something now and then
            victim = rng.choice(live)
            hh.sched.finish(victim)
            victim.finish_reason = "abort"
            hh.check_state()

    for _ in range(3):
        h.add(*pending.pop())
    h.run(on_step=feed)
    while pending:  # whatever the random feed left over
        h.add(*pending.pop())
        h.run()
    h.check_done()
    if prefix:
        assert any(seq.num_cached_tokens for seq in h.seqs)


# -----------------------------------------------------------------------------------------
# SamplingParams

@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_p=2), "min_p"),
    (dict(logprobs=30), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=""), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop=["a", 5]), "stop"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(temperature=True), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(seed=1.5), "seed"),
])
def test_sampling_params_rejects_invalid_values(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_valid_edges_and_normalization():
    sp = SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1, max_tokens=1, min_tokens=1,
                        logprobs=20, stop="x", repetition_penalty=0.5)
    assert sp.greedy and sp.top_k == 0 and sp.stop_strings == ["x"] and sp.stop_token_ids == []
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop=None).stop_strings == []
    assert not SamplingParams().greedy
