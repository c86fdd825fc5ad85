"""Which sequences propose tokens in a step, how many, and what their verification leaves behind.

- A sequence proposes only while decoding (its last token is its only one without KV), never as a
  pooling request
  or under structured outputs (their grammar would have to advance over tokens that may be rejected;
  such a request
  decodes one token a step), and only in a step whose batch holds at most disable_by_batch_size
  sequences: past that,
  verifying k + 1 tokens per sequence costs more compute than the weight reads it saves.
- k is num_speculative_tokens, lowered to what max_tokens, max_model_len and the step's token budget
  leave.
- Adaptive (speculative_config "adaptive", on by default):
  - a verification that accepts none of a sequence's proposals makes it sit out 2^m - 1 steps (m:
    such
    verifications in a row, the pause at most MAX_PAUSE_STEPS); one accepted token resets m;
  - whether proposals pay depends on the batch: a small one is bound by reading the weights, and k +
    1 rows per
    sequence cost little more than one; a large one is bound by compute, and every proposed row
    costs as much as a
    token. So each batch-size class (1, 2-3, 4-7, ...) measures its decode steps: tokens emitted per
    second with
    proposals and without (a moving average of each), keeps the faster way, and runs the other one
    step in
    PROBE_EVERY to follow a workload that changes (one in up to MAX_PROBE_EVERY while the probes
    confirm the choice). Decisions only change speed: the output is exact either way.
- KV: the scheduler places the proposals (engine/scheduler.py add_proposals: free blocks only, a
  proposal never preempts anyone) and, after verification, rolls the rejected ones' slots back and
  returns the blocks past the accepted tokens (update). The speculator proposes and counts
  acceptance; it writes no progress and no blocks. Only accepted tokens ever enter token_ids, so
  prefix-cache hashes only ever cover them."""
import logging
import time
from collections.abc import Callable

from vlinfer.config import SpeculativeConfig
from vlinfer.engine.scheduler import SchedulerOutput
from vlinfer.engine.sequence import Sequence
from vlinfer.engine.mtp_head import MTPHead
from vlinfer.engine.speculative.draft_model import DraftModel
from vlinfer.engine.speculative.ngram import propose_ngram

logger = logging.getLogger("vlinfer")
MAX_PAUSE_STEPS = 31
# decode steps of a batch-size class between two runs of the way it is not using, at first
PROBE_EVERY = 32
MAX_PROBE_EVERY = 512
RATE_MEMORY = 0.8  # the moving average keeps this much of its last value at each measured step


def _decoding(seq: Sequence) -> bool:
    """Its last token is the only one without KV: this step computes one token of it, and could
    verify proposals."""
    return seq.num_computed_tokens == seq.num_tokens - 1


class BatchClassRates:
    """Per batch-size class, tokens emitted per second of decode steps with proposals (True) and
    without (False)."""

    def __init__(self):
        self.rates: dict[int, dict[bool, float]] = {}
        self.steps: dict[int, int] = {}
        # The class's next probe of the way it is not using: the interval doubles (up to
        # MAX_PROBE_EVERY) while probes leave the choice as it was, so a settled class spends ever
        # fewer steps on the slower way.
        self.next_probe: dict[int, int] = {}
        self.probe_every: dict[int, int] = {}
        self.choice_at_probe: dict[int, bool] = {}

    def choose(self, size: int) -> bool:
        """Whether this decode step proposes: untried ways first, then the faster, and now and then
        the other."""
        c = size.bit_length()
        rates = self.rates.setdefault(c, {})
        self.steps[c] = step = self.steps.get(c, 0) + 1
        for way in (True, False):
            if way not in rates:
                return way
        best = rates[True] >= rates[False]
        if step < self.next_probe.setdefault(c, PROBE_EVERY):
            return best
        settled = self.choice_at_probe.get(c) == best
        every = min(2 * self.probe_every.get(c, PROBE_EVERY),
                    MAX_PROBE_EVERY) if settled else PROBE_EVERY
        self.probe_every[c], self.choice_at_probe[c], self.next_probe[c] = every, best, step + every
        return not best

    def record(self, size: int, proposed: bool, tokens: int, seconds: float) -> None:
        rates = self.rates[size.bit_length()]
        rate = tokens / max(seconds, 1e-9)
        rates[proposed] = rate if proposed not in rates else RATE_MEMORY * rates[proposed] + (
            1 - RATE_MEMORY) * rate


def _room(seq: Sequence, k: int, reserve: Callable[[Sequence, int], bool]) -> int:
    """k lowered to the MTP proposals whose K and V fit: proposal j (from 1) is made at position
    num_computed_tokens + j - 2, so k of them need k - 1 tokens of room past the computed ones (the
    step scheduled one); free blocks only, as add_proposals."""
    while k > 1 and not reserve(seq, k - 1):
        k -= 1
    return k


def placeholder_token_ids(hf_config) -> frozenset[int]:
    """The model's image and video placeholder tokens: the input processor places them, never a
    proposal."""
    ids = (getattr(hf_config, "image_token_id", None), getattr(hf_config, "video_token_id", None))
    return frozenset(t for t in ids if t is not None)


class Speculator:
    """config None: a speculator that never proposes. draft: the draft model of method
    "draft_model", its KV pool allocated (DraftModel.allocate_kv_cache); mtp: the target runner's
    MTP head (method "mtp"); neither proposes n-grams."""

    def __init__(self, config: SpeculativeConfig | None, max_model_len: int,
                 placeholder_ids: frozenset[int], draft: DraftModel | None = None,
                 mtp: MTPHead | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.placeholder_ids = placeholder_ids  # image / video placeholder tokens: never proposed
        self.draft = draft
        self.mtp = mtp
        # Totals over the engine's life (the server's /metrics): verifications with proposals,
        # tokens proposed, tokens accepted, and accepted tokens by their position in the proposal.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * (config.num_speculative_tokens
                                            if config is not None else 0)
        # The adaptive rule's state by seq_id, the speculator's own (dropped at release):
        # verifications in a row that accepted nothing, and the steps a sequence still sits out.
        self.misses: dict[int, int] = {}
        self.pause_steps: dict[int, int] = {}
        self.batch_rates = BatchClassRates()
        self.said_structured = False
        # this decode step's (batch size, proposing, start)
        self._measuring: tuple[int, bool, float] | None = None
        if config is not None:
            ngrams = (f", n-grams of {config.prompt_lookup_max} down to {config.prompt_lookup_min} "
                      "tokens" if draft is None else "")
            method = config.method if draft is None else f"draft model {config.model}"
            method = "the checkpoint's MTP head" if mtp is not None else method
            logger.info("speculative decoding: %s, %d tokens per step%s, off in steps of more than "
                        "%d sequences", method, config.num_speculative_tokens, ngrams,
                        config.disable_by_batch_size)

    def _wanted(self, seq: Sequence, n: int) -> int:
        """How many tokens this sequence may propose this step (0: none)."""
        if n != 1 or not _decoding(seq) or seq.pooling_params is not None:
            return 0
        parked = seq.reasoning is not None and seq.reasoning.parked_matcher is not None
        if seq.grammar_matcher is not None or parked:
            if not self.said_structured:  # once per engine: a rule, not a failure
                logger.info(
                    "speculative decoding: requests with structured outputs decode one token a "
                    "step (their "
                    "grammar would have to advance over proposals that may be rejected)")
                self.said_structured = True
            return 0
        if self.pause_steps.get(seq.seq_id):
            self.pause_steps[seq.seq_id] -= 1
            return 0
        return min(self.config.num_speculative_tokens,
                   (seq.sampling_params.max_tokens or self.max_model_len) -
                   seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)

    def propose(self, batch: SchedulerOutput,
                reserve: Callable[[Sequence, int], bool] | None = None
                ) -> list[tuple[int, list[int]]]:
        """The step's proposals, (batch index, tokens) of the decoding sequences that propose; the
        scheduler places them (add_proposals) within the step's token budget and free KV blocks.
        reserve: the scheduler's (Scheduler.reserve), for the MTP head's K and V of its proposals
        (the positions their verification computes, from free blocks only)."""
        self._measuring = None
        if self.config is None or len(batch.seqs) > self.config.disable_by_batch_size:
            return []
        if self.config.adaptive and all(map(_decoding, batch.seqs)):
            proposing = self.batch_rates.choose(len(batch.seqs))
            self._measuring = (len(batch.seqs), proposing, time.perf_counter())
            if not proposing:
                return []
        wanted = [(i, k) for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                  if (k := self._wanted(seq, n)) > 0]
        if not wanted:
            return []
        seqs = [batch.seqs[i] for i, _ in wanted]
        if self.draft is not None:
            proposals = self.draft.propose(seqs, [k for _, k in wanted], self.placeholder_ids)
        elif self.mtp is not None:
            ks = [_room(seq, k, reserve) for seq, (_, k) in zip(seqs, wanted)]
            proposals = self.mtp.propose(seqs, ks, self.placeholder_ids)
        else:
            c = self.config
            proposals = [propose_ngram(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max,
                                       self.placeholder_ids) for seq, (_, k) in zip(seqs, wanted)]
        return [(i, proposal) for (i, _), proposal in zip(wanted, proposals)]

    def record(self, sampled: list[tuple[Sequence, list[int], list]]) -> None:
        """After the output processor took the step's tokens, before the scheduler rolls back what
        was rejected: count each verified sequence's accepted proposals (totals, its request's
        metrics), apply the adaptive rules, and time the decode step."""
        if self._measuring is not None:
            size, proposing, start = self._measuring
            self.batch_rates.record(size, proposing, sum(len(tokens) for _, tokens, _ in sampled),
                                    time.perf_counter() - start)
        for seq, tokens, _ in sampled:
            k = len(seq.spec_token_ids)
            if not k:
                continue
            accepted = len(tokens) - 1
            seq.metrics.spec_num_drafts += 1
            seq.metrics.spec_num_draft_tokens += k
            seq.metrics.spec_num_accepted_tokens += accepted
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += accepted
            for position in range(accepted):
                self.accepted_per_position[position] += 1
            if self.config.adaptive:
                misses = 0 if accepted else self.misses.get(seq.seq_id, 0) + 1
                self.misses[seq.seq_id] = misses
                self.pause_steps[seq.seq_id] = min(2 ** misses - 1, MAX_PAUSE_STEPS)

    def release(self, seq: Sequence) -> None:
        """A sequence finished or was aborted: its adaptive state goes, its draft KV returns to the
        draft's pool."""
        self.misses.pop(seq.seq_id, None)
        self.pause_steps.pop(seq.seq_id, None)
        if self.draft is not None:
            self.draft.release(seq)
