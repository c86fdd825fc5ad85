"""Continuous batching: each step gives every running sequence its next tokens (one for a decode, a chunk for
a prefill) within a token budget, admits waiting sequences while blocks and budget last, and preempts by
recompute when the KV pool runs dry."""
from collections import deque
from dataclasses import dataclass

from vlinfer.engine.block_manager import BlockManager
from vlinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step, from its num_computed_tokens on

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 0):
        self.block_manager = block_manager
        self.max_loras = max_loras  # distinct LoRA adapters per step (engine/lora_manager.py's slots)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last admitted is preempted first
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

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], [])
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
        # Admit new work only when the running set did not have to give up blocks this step.
        adapters = {s.lora_request.lora_int_id for s in self.running if s.lora_request is not None}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            lora_id = seq.lora_request.lora_int_id if seq.lora_request is not None else None
            if lora_id is not None and lora_id not in adapters and len(adapters) >= self.max_loras:
                break  # its adapter would not find a slot this step
            if lora_id is not None:
                adapters.add(lora_id)
            if not seq.block_table:
                cached = self.block_manager.allocate_prefix(seq)
                seq.num_computed_tokens = cached
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate(seq, n):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the schedule, whether it finished or was aborted, and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
