"""The MTP head's passes over the target's paged KV pool, a part of the model runner
(docs/speculative.md "MTP"). The head at position p reads the target's final hidden state h_p and
the input row of token p + 1, so its K and V at p can be written once token p + 1 has run through
the target:

- `catch_up`, inside every target forward (chunked prefill, decode, verification alike): each target
  row at position p >= 1 pairs its own input row with h_{p-1} (the row before it in the step, or,
  for a sequence's first row, the hidden state its state slot kept) and runs the head at p - 1,
  writing its K and V there; then the slot keeps the step's last hidden state. A verification
  that rejects a proposal has its slot put back, this hidden state with the rest (the MTP head
  runs on hybrid targets only, where every rejection restores the state: model_runner.py), and
  the kept tokens run again; the pairs it wrote past them are rewritten, by the pairs of the tokens
  kept there, before any later position reads them.
- `propose`: the last token (sampled, text) with the kept hidden state gives the first proposal;
  each further one feeds the head's own output back, one position on (vLLM's MTP proposer). Their
  K and V go to the positions the verification then computes, rewritten by its catch-up.

Keeping the hidden state in the state slot makes it follow the sequence's state everywhere the
pool moves it: prefix-cache checkpoints (a hit restores h at the block boundary), the snapshot a
hybrid verification puts back, and preemption (the slot goes; a recompute starts at position 0,
which pairs with nothing). `check_mtp_target` says, before any weight is read, whether a runner is
built with the head, and refuses by name what cannot run it."""
from dataclasses import dataclass

import torch

from vlinfer.config import SpeculativeConfig
from vlinfer.engine.sequence import Sequence
from vlinfer.engine.step_inputs import positions
from vlinfer.layers import ForwardContext, ModelContext
from vlinfer.models import get_model_class
from vlinfer.models.interfaces import HasMTPHead, HasStateSlots

MTP_PREFIX = "mtp."


def check_mtp_target(config: SpeculativeConfig | None, hf_config, tensors: dict | None,
                     name: str) -> bool:
    """Whether a runner is built with the MTP head (method "mtp"); where it is, a target that can
    run it: a model family with an MTP head (a hybrid one: its kept hidden state lives in the
    state slots) whose checkpoint holds the head's tensors (`tensors`: its tensor index, None
    where the caller has none), else a refusal naming what lacks."""
    if config is None or config.method != "mtp":
        return False
    model_cls = get_model_class(hf_config)
    if not (issubclass(model_cls, HasMTPHead) and issubclass(model_cls, HasStateSlots)):
        raise ValueError(
            f"speculative_config: method='mtp' runs the MTP heads of Qwen3.5 / Qwen3-Next "
            f"checkpoints; {name} ({model_cls.__name__}) has none: use 'ngram' or a draft model")
    if tensors is not None and not any(t.startswith(MTP_PREFIX) for t in tensors):
        raise ValueError(
            f"speculative_config: method='mtp' needs the checkpoint's MTP head weights (mtp.*), "
            f"and {name} has none (a checkpoint saved by transformers drops them)")
    return True


@dataclass
class CatchUp:
    """One step's catch-up plan (CPU tensors), over its P pairs and the B' sequences that have
    any: each pair's input row of the step and its hidden state's index into the step's hidden
    states followed by one kept row per sequence; the head's attention metadata; and per sequence
    of the step its state slot and last row."""
    rows: torch.Tensor  # [P]
    prev: torch.Tensor  # [P]
    positions: torch.Tensor  # [P] or [3, P]
    slot_mapping: torch.Tensor  # [P]
    cu_seqlens_q: torch.Tensor  # [B' + 1]
    seq_lens: torch.Tensor  # [B']
    block_tables: torch.Tensor  # [B', max_blocks]
    state_slots: torch.Tensor  # [B]
    last_rows: torch.Tensor  # [B]


def _slots(seq: Sequence, start: int, end: int, block_size: int) -> torch.Tensor:
    token = torch.arange(start, end)
    table = torch.tensor(seq.block_table, dtype=torch.long)
    return table[token // block_size] * block_size + token % block_size


def _tables(seqs: list[Sequence]) -> torch.Tensor:
    tables = torch.full((len(seqs), max(len(s.block_table) for s in seqs)), -1, dtype=torch.int32)
    for i, seq in enumerate(seqs):
        tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
    return tables


def plan_catch_up(seqs: list[Sequence], num_new_tokens: list[int], block_size: int,
                  mrope: bool) -> CatchUp:
    """The catch-up of a step that runs num_new_tokens rows per sequence (proposals included) from
    each one's num_computed_tokens: a pure function, like step_inputs.build_step_inputs."""
    total = sum(num_new_tokens)
    rows, prev, pos, slots, cu, lens, held = [], [], [], [], [0], [], []
    base = 0
    for b, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
        start = seq.num_computed_tokens
        first = 0 if start > 0 else 1  # the row at position 0 pairs with nothing
        if first < n:  # pairs at positions start + first - 1 .. start + n - 2
            lo, hi = start + first - 1, start + n - 1
            rows += range(base + first, base + n)
            prev += [total + b if j == 0 else base + j - 1 for j in range(first, n)]
            pos.append(positions(seq, lo, hi, mrope))
            slots.append(_slots(seq, lo, hi, block_size))
            cu.append(cu[-1] + hi - lo)
            lens.append(hi)
            held.append(seq)
        base += n
    last = torch.tensor(num_new_tokens).cumsum(0) - 1
    return CatchUp(
        rows=torch.tensor(rows, dtype=torch.long), prev=torch.tensor(prev, dtype=torch.long),
        positions=torch.cat(pos, -1) if pos else torch.zeros(0, dtype=torch.long),
        slot_mapping=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=_tables(held) if held else torch.zeros(0, 0, dtype=torch.int32),
        state_slots=torch.tensor([seq.state_slot for seq in seqs], dtype=torch.long),
        last_rows=last)


class MTPHead:
    def __init__(self, model: HasMTPHead, ctx: ModelContext, device: torch.device,
                 block_size: int, mrope: bool):
        self.model, self.ctx, self.device = model, ctx, device
        self.block_size, self.mrope = block_size, mrope
        self.num_catch_up_rows = 0  # over the engine's life, for tests and logs
        self.num_proposal_rows = 0

    @property
    def kept(self) -> torch.Tensor:
        """[slots, hidden]: each sequence's target hidden state at its last computed position."""
        return self.model.mtp.states[0]

    def _run(self, embeds, hidden, positions_, slot_mapping, cu_seqlens_q, seq_lens,
             block_tables, decode_only: bool) -> torch.Tensor:
        dev = self.device
        step = ForwardContext(slot_mapping=slot_mapping.to(dev), cu_seqlens_q=cu_seqlens_q.to(dev),
                              seq_lens=seq_lens.to(dev), block_tables=block_tables.to(dev),
                              decode_only=decode_only)
        with self.ctx.stepping(step):
            return self.model.mtp_forward(embeds, hidden, positions_.to(dev))

    def catch_up(self, plan: CatchUp, input_ids: torch.Tensor, hidden: torch.Tensor,
                 mm_inputs: dict) -> torch.Tensor | None:
        """Inside the target's forward, after its layers: the head's K and V at every position
        whose next token ran in the step; each slot then keeps its sequence's last row. Returns
        the head's output rows, one per pair (None without any)."""
        dev = self.device
        slots = plan.state_slots.to(dev)
        out = None
        if len(plan.rows):
            kept = self.kept.index_select(0, slots)  # before this step writes them
            embeds = self.model.mtp_embeds(input_ids.to(dev), **mm_inputs)
            rows = plan.rows.to(dev)
            before = torch.cat([hidden, kept.to(hidden.dtype)]).index_select(0, plan.prev.to(dev))
            out = self._run(embeds.index_select(0, rows), before, plan.positions,
                            plan.slot_mapping, plan.cu_seqlens_q, plan.seq_lens,
                            plan.block_tables, decode_only=False)
            self.num_catch_up_rows += len(plan.rows)
        self.kept.index_copy_(0, slots, hidden.index_select(0, plan.last_rows.to(dev)).to(
            self.kept.dtype))
        return out

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int],
                never: frozenset[int]) -> list[list[int]]:
        """Up to ks[i] greedy tokens for each decoding sequence (its last token the only one
        without KV), cut before a placeholder token. Each sequence has KV room for positions
        num_computed_tokens - 1 .. + ks[i] - 2 (the caller reserved it)."""
        dev = self.device
        proposals = [[] for _ in seqs]
        live = list(range(len(seqs)))
        ids = torch.tensor([seq.token_ids[-1] for seq in seqs], device=dev)
        hidden = self.kept.index_select(
            0, torch.tensor([seq.state_slot for seq in seqs], device=dev)).to(self.ctx.dtype)
        step = 0
        while live:
            ps = [seqs[i].num_computed_tokens - 1 + step for i in live]
            group = [seqs[i] for i in live]
            out = self._run(
                self.model.mtp_embeds(ids), hidden,
                torch.cat([positions(s, p, p + 1, self.mrope) for s, p in zip(group, ps)], -1),
                torch.cat([_slots(s, p, p + 1, self.block_size) for s, p in zip(group, ps)]),
                torch.arange(len(live) + 1, dtype=torch.int32),
                torch.tensor([p + 1 for p in ps], dtype=torch.int32), _tables(group),
                decode_only=True)
            self.num_proposal_rows += len(live)
            tokens = self.model.compute_logits(out).argmax(-1)
            going = []
            for row, (i, token) in enumerate(zip(live, tokens.tolist())):
                if token in never:  # a placeholder ends the proposal before it
                    continue
                proposals[i].append(token)
                if len(proposals[i]) < ks[i]:
                    going.append(row)
            step += 1
            index = torch.tensor(going, device=dev, dtype=torch.long)
            live = [live[r] for r in going]
            ids, hidden = tokens.index_select(0, index), out.index_select(0, index)
        return proposals
