"""Continuous batching: each step gives every running sequence its next tokens (one for a decode, a
chunk for a prefill) within a token budget, admits waiting sequences while blocks and budget last,
and preempts by recompute when the KV pool runs dry.

The scheduler is the one owner of a sequence's progress (num_computed_tokens), its proposals
(spec_token_ids) and its KV blocks (the block manager): the engine hands it each step's result
(update), as vLLM's update_from_output and nano-vllm's postprocess take it; the speculator only
proposes and counts acceptance."""
from collections import deque
from dataclasses import dataclass, field

from vlinfer.engine.block_manager import BlockManager
from vlinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    # tokens each sequence computes this step, from its num_computed_tokens on
    num_new_tokens: list[int]
    # a hybrid model's state copies (source slot, destination slot): prefix hits' checkpoints into
    # their sequences' slots before the forward, checkpoints of block boundaries after it
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


def num_rejected(seq: Sequence, tokens: list[int]) -> int:
    """How many of seq's proposals its verification's sampled tokens rejected."""
    return len(seq.spec_token_ids) - (len(tokens) - 1)


def restores_state(seq: Sequence, tokens: list[int]) -> bool:
    """A hybrid sequence whose verification rejected a proposal: its linear layers' state ran
    over every proposal and has no per-token history, so the state it verified from is put back
    (engine/model_runner.py) and its last token and the accepted ones are computed again (update).
    """
    return seq.state_slot is not None and num_rejected(seq, tokens) > 0


class Scheduler:
    """A draft model (speculative/draft_model.py) keeps a Scheduler of its own over its pool for its
    shadow sequences: it batches them itself (schedule() never runs there) and goes through reserve,
    update, rollback and free, so a shadow's progress and blocks have its target's owner."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 0):
        self.block_manager = block_manager
        # distinct LoRA adapters per step (engine/lora_manager.py's slots)
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        # in admission order: the last admitted is preempted first
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # over the scheduler's life, for logs and tests

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _preempt(self, seq: Sequence) -> None:
        # Recompute rather than swap: drop its KV and let it prefill prompt + output again later.
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _cut(self, seq: Sequence, n: int) -> int:
        """A hybrid model's prefill chunk, with prefix caching, ends at a block boundary where it
        crosses one, and at the last boundary before the last token (the longest prefix a later
        request can hit) where it crosses that: the state there is checkpointed exact (vLLM's
        "align" mode). The tail past it runs next step."""
        bm, start = self.block_manager, seq.num_computed_tokens
        last = bm.shareable_tokens(seq.num_tokens)
        if not bm.checkpointing or start >= last:
            return n
        end = min(start + n, last) // bm.block_size * bm.block_size
        return end - start if end > start else n

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        """A hybrid model's later completion of an n > 1 request waits while an earlier one
        prefills up to its checkpoint, then hits it (the state copied on fork) rather than
        prefilling the prompt beside it."""
        if not self.block_manager.checkpointing or seq.prompt_logprobs is not None:
            return False
        bm = self.block_manager
        return any(s.request_group == seq.request_group and s.num_computed_tokens <
                   bm.shareable_tokens(s.num_prompt_tokens) for s in self.running)

    def _schedule(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        if seq.restore_slot is not None:  # its prefix hit's state, into its own slot
            out.state_restores.append((seq.restore_slot, seq.state_slot))
            seq.restore_slot = None
        save = self.block_manager.reserve_checkpoint(seq, n)
        if save is not None:
            out.state_saves.append(save)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], [])
        self.block_manager.drop_pending_checkpoints()  # of a step that failed before its update
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._cut(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            while not self.block_manager.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._schedule(out, seq, n)
                budget -= n
                i += 1
        # Admit new work only when the running set did not have to give up blocks this step.
        adapters = {s.lora_request.lora_int_id for s in self.running if s.lora_request is not None}
        while self.waiting and budget > 0 and len(
                self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            lora_id = seq.lora_request.lora_int_id if seq.lora_request is not None else None
            if lora_id is not None and lora_id not in adapters and len(adapters) >= self.max_loras:
                break  # its adapter would not find a slot this step
            if self._sibling_prefilling(seq):
                break
            if lora_id is not None:
                adapters.add(lora_id)
            if not seq.block_table:
                cached = self.block_manager.allocate_prefix(seq)
                seq.num_computed_tokens = cached
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
            n = self._cut(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if not self.block_manager.allocate(seq, n):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(out, seq, n)
            budget -= n
        return out

    def add_proposals(self, batch: SchedulerOutput, proposals: list[tuple[int, list[int]]]) -> None:
        """Put the speculator's proposals (batch index, tokens) into the step: each cut to the token
        budget the step leaves and placed in free blocks only (a proposal never preempts anyone), or
        dropped. A placed one is verified with its sequence's last token (seq.spec_token_ids,
        counted in num_new_tokens)."""
        budget = self.max_num_batched_tokens - sum(batch.num_new_tokens)
        for i, proposal in proposals:
            seq, proposal = batch.seqs[i], proposal[:budget]
            if proposal and self.reserve(seq, 1 + len(proposal)):
                seq.spec_token_ids = proposal
                batch.num_new_tokens[i] += len(proposal)
                budget -= len(proposal)

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """KV room for num_new_tokens more tokens after seq.num_computed_tokens, from free blocks
        only (False, and nothing taken, when too few are free): proposals, a draft's shadows."""
        return self.block_manager.allocate(seq, num_new_tokens)

    def update(self, batch: SchedulerOutput,
               sampled: list[tuple[Sequence, list[int], list]]) -> None:
        """A step's result, once the output processor appended its sampled tokens: each scheduled
        sequence's KV now covers its num_new_tokens more tokens; a verified one keeps only its last
        token's and its accepted proposals' KV (the rejected slots roll back, the blocks past its
        tokens return to the pool); full blocks enter the prefix cache."""
        started = {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            started[seq.seq_id] = seq.num_computed_tokens
            seq.num_computed_tokens += n
        for seq, tokens, _ in sampled:
            if seq.spec_token_ids:
                rejected = num_rejected(seq, tokens)
                keep = seq.num_computed_tokens - rejected
                if restores_state(seq, tokens):
                    # its state covers the rejected proposals: the runner put back the state it
                    # verified from (restores_state), and the kept tokens run again next step
                    keep = started[seq.seq_id]
                # A stop may have cut the tokens appended: its KV never reaches past them.
                self.rollback(seq, min(keep, seq.num_tokens))
                seq.spec_token_ids = []
        for seq in batch.seqs:
            self.block_manager.cache_full_blocks(seq)
        self.block_manager.commit_checkpoints()

    def rollback(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Keep seq's KV over its first num_computed_tokens tokens at most and free the blocks past
        those its tokens need: rejected proposals (update), a draft shadow's stale tokens."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_computed_tokens)
        self.block_manager.trim(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the schedule, whether it finished or was aborted, and free its
        blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.free(seq)
        seq.spec_token_ids = []  # proposals of a step that failed before its update
        seq.status = SequenceStatus.FINISHED

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks to the pool: at finish, or a draft's unscheduled shadow."""
        self.block_manager.free(seq)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached block; only while no sequence holds one (else False)."""
        return self.block_manager.reset_prefix_cache()
