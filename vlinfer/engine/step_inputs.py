"""One step's model inputs from the scheduled sequences: a pure function of its arguments (no model,
no device), so tests build and check a step's tensors by hand (tests/engine/test_step_inputs.py)."""
from dataclasses import dataclass, field

import torch

from vlinfer.engine.sequence import Sequence


@dataclass
class StepInputs:
    """One step's model inputs, built by rank 0 and run by every rank. CPU tensors, except image
    rows from the encoder cache (on rank 0's device; the control channel sends them as bytes)."""
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T], or [3, T] for multimodal rotary
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    decode_only: bool
    mm_inputs: dict  # mm_mask, mm_embeds, deepstack_embeds for steps with image tokens
    logits_indices: torch.Tensor | None  # rows whose logits are computed; None: every row
    compute_logits: bool = True
    # Rows whose pooled output (hidden state, or a classifier's logits) pooling requests take: each
    # one's last prompt token, in the step where its prefill ends. None or empty: none ends here.
    pool_indices: torch.Tensor | None = None
    # Each token's LoRA slot (-1: the base model); None when no request in the step runs one.
    lora_slots: torch.Tensor | None = None
    # A hybrid model's state slot per sequence [B] and whether it holds the sequence's state so
    # far [B] (tokens computed before this step); None where no sequence holds a slot.
    state_slots: torch.Tensor | None = None
    has_state: torch.Tensor | None = None
    # [B+1] where each sequence's tokens start, proposals included: the linear layers run a
    # verification as one chunk (cu_seqlens_q splits it into one-token attention rows)
    state_cu_seqlens: torch.Tensor | None = None
    # state slot copies (source, destination) before the forward (prefix hits restoring their
    # checkpoints) and after it (checkpoints of block boundaries): scheduler.SchedulerOutput's
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # With an MTP head: the step's catch-up (engine/mtp_head.py CatchUp), run after the layers
    mtp_catch_up: object | None = None


@dataclass
class StepPlan:
    """What a step's outputs go back to: the sequences that sample a token (in logits row order,
    after the prompt rows), the (sequence, prompt position) pairs whose prompt logprobs it
    computes, and the pooling sequences whose prefill ends in it."""
    sample_seqs: list[Sequence] = field(default_factory=list)
    prompt_rows: list[tuple[Sequence, int]] = field(default_factory=list)
    pool_seqs: list[Sequence] = field(default_factory=list)


def positions(seq: Sequence, start: int, end: int, mrope: bool) -> torch.Tensor:
    """Rotary positions of tokens start..end: [n], or [3, n] with multimodal rotary."""
    if not mrope:
        return torch.arange(start, end)
    if seq.mrope_positions is None:  # a text-only prompt: all three rows are the token index
        return torch.arange(start, end).expand(3, -1)
    prompt_end = min(end, seq.num_prompt_tokens)
    parts = []
    if start < prompt_end:
        parts.append(seq.mrope_positions[:, start:prompt_end])
    if end > prompt_end:  # generated tokens continue on all three rows from the request's delta
        generated = torch.arange(max(start, prompt_end), end).expand(3, -1)
        parts.append(generated + seq.mrope_position_delta)
    return torch.cat(parts, 1)


def build_step_inputs(seqs: list[Sequence], num_new_tokens: list[int], block_size: int,
                      mrope: bool, lora_slot_of: dict[int, int] | None = None
                      ) -> tuple[StepInputs, StepPlan]:
    """The step's inputs (mm_inputs left empty: the vision encoder fills them) and its plan. Each
    sequence runs tokens num_computed_tokens .. + n, then its speculative proposals. Logits rows:
    the prompt positions first, then the sampling rows. lora_slot_of: {lora_int_id: slot} of the
    step's adapters (LoRAManager.activate)."""
    bs = block_size
    input_ids, pos, slots, cu_seqlens_q, seq_lens = [], [], [], [0], []
    sample_indices, prompt_indices, pool_indices, plan = [], [], [], StepPlan()
    max_blocks = max(len(seq.block_table) for seq in seqs)
    block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    for i, seq in enumerate(seqs):
        block_tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
    segments = []  # each attention segment's sequence (a row of block_tables)
    for i, (seq, n, table) in enumerate(zip(seqs, num_new_tokens, block_tables)):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        input_ids.extend(seq.token_ids[start:end] + seq.spec_token_ids)  # proposals follow
        pos.append(positions(seq, start, end, mrope))
        token = torch.arange(start, end)
        slots.append(table[token // bs].long() * bs + token % bs)
        if seq.prompt_logprobs is not None:  # position j's logits: prompt token j + 1's logprob
            for j in range(start, min(end, seq.num_prompt_tokens - 1)):
                prompt_indices.append(cu_seqlens_q[-1] + j - start)
                plan.prompt_rows.append((seq, j + 1))
        # A verification (the last token and its proposals) runs as one-token decode rows, each
        # attending up to itself: decoding's kernels, graphs and rounding, so its greedy tokens are
        # decoding's own.
        for seq_len in (range(start + 1, end + 1) if seq.spec_token_ids else (end,)):
            seq_lens.append(seq_len)
            cu_seqlens_q.append(cu_seqlens_q[-1] + (1 if seq.spec_token_ids else n))
            segments.append(i)
        if end == seq.num_tokens and seq.pooling_params is not None:  # a pooling prefill ends
            pool_indices.append(cu_seqlens_q[-1] - 1)
            plan.pool_seqs.append(seq)
        elif end == seq.num_tokens + len(seq.spec_token_ids):  # reaches the end: last rows sample
            last = cu_seqlens_q[-1]
            sample_indices.extend(range(last - 1 - len(seq.spec_token_ids), last))
            plan.sample_seqs.append(seq)
    inputs = StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.cat(pos, -1),
        slot_mapping=torch.cat(slots),
        cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables if len(segments) == len(seqs) else block_tables[segments],
        decode_only=len(input_ids) == len(seq_lens),
        mm_inputs={},
        logits_indices=torch.tensor(prompt_indices + sample_indices, dtype=torch.long),
        pool_indices=torch.tensor(pool_indices, dtype=torch.long),
    )
    if any(seq.state_slot is not None for seq in seqs):
        inputs.state_cu_seqlens = torch.tensor([0] + num_new_tokens).cumsum(0).to(torch.int32)
        inputs.state_slots = torch.tensor([seq.state_slot for seq in seqs], dtype=torch.long)
        inputs.has_state = torch.tensor([seq.num_computed_tokens > 0 for seq in seqs])
    if lora_slot_of:  # each token's LoRA slot
        inputs.lora_slots = torch.cat([
            torch.full((n,), lora_slot_of[seq.lora_request.lora_int_id] if seq.lora_request else -1,
                       dtype=torch.long)
            for seq, n in zip(seqs, num_new_tokens)])
    return inputs, plan
