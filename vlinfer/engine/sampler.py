"""Turns the logits of each sequence's last position into its next token, with vLLM's sampling
options.

The chain, per row, in this order (tests/engine/test_sampling.py checks each step against
transformers' logits processors on the same logits, and the whole chain against theirs in sequence):

0. logprobs, when asked for: log_softmax of the raw model logits in float32, before anything below,
   the grammar
   mask included: one rule for every request, vLLM's default (logprobs_mode="raw_logprobs"), and
   what the OpenAI
   API reports. Each entry carries its rank in the vocabulary by that logprob.
1. structured outputs: the grammar's token bitmask (the op table's apply_token_bitmask, defined in
   ops/reference/bitmask.py), for constrained rows, all in one pass, so every later step only sees
   the tokens the grammar allows.
2. process_logits, on every row (greedy ones too, so they change the arg-max):
   a. logit_bias added (transformers' SequenceBiasLogitsProcessor with one-token sequences; vLLM
   adds it before
      the penalties too);
   b. repetition_penalty over prompt and output tokens (RepetitionPenaltyLogitsProcessor: positive
   logits divided,
      negative ones multiplied), then presence and frequency penalties over output tokens only
      (OpenAI's and vLLM's
      rule: logits -= presence * (count > 0) + frequency * count);
   c. masks to -inf: every token outside allowed_token_ids; a bad word's last token when the output
   so far ends
      with the rest of the word (vLLM: output tokens only, not the prompt); EOS and stop_token_ids
      while fewer than
      min_tokens tokens are out (MinNewTokensLengthLogitsProcessor; EOS even under ignore_eos, as
      vLLM, whose
      min_tokens masks all its stop ids). A masked logit stays -inf through a and b, so masks
      commute with them.
   d. a thinking budget spent (SamplingParams.thinking_token_budget): every token but the end of
      the thinking (`</think>`) masked, whatever a-c left, so the row emits it (vLLM's and
      llama.cpp's rule: the engine ends the thinking, the answer follows).
   Greedy rows (temperature 0) take the arg-max here.
3. warp_logits, on sampled rows: temperature, top-k, top-p, min-p, in transformers' order
   (TemperatureLogitsWarper,
   TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper). vLLM applies min-p right after
   temperature, before top-k
   and top-p: the two orders differ only when min_p is combined with top_k or top_p.
4. One inverse-CDF draw per row from the row's own generator, which never lands on a token of
   probability 0.

Speculative decoding verifies proposed tokens in the same pass: a sequence with k proposals has k +
1 rows, row j seeing the first j proposals as output (their penalties, bad words, min_tokens), and
`sample` keeps the proposals the model accepts (exactly, by the rules in its docstring) and adds one
token of its own.

Randomness comes from each sequence's own generator, so a seeded request draws the same tokens
whatever else shares its batch."""
from __future__ import annotations

import torch

from vlinfer.engine.sequence import PromptAndOutput, Sequence
from vlinfer.ops.reference import bitmask as token_bitmask_reference
from vlinfer.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _index(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token id occurs in each list, in one
    scatter."""
    rows = [r for r, tokens in enumerate(token_lists) for _ in tokens]
    cols = [t for tokens in token_lists for t in tokens]
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    # Ids past the logits (a tokenizer larger than the model's head) land in a spare column and are
    # dropped.
    cols_t = _index(cols, device).clamp_max(vocab)
    counts.index_put_((_index(rows, device), cols_t), torch.ones(len(cols), device=device),
                      accumulate=True)
    return counts[:, :vocab]


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        bias = p.logit_bias or {}
        rows += [i] * len(bias)
        cols += list(bias)
        values += list(bias.values())
    if rows:
        logits.index_put_((_index(rows, logits.device), _index(cols, logits.device)),
                          torch.tensor(values, dtype=logits.dtype, device=logits.device),
                          accumulate=True)


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    vocab, dev = logits.shape[-1], logits.device
    rep = [i for i, s in enumerate(seqs) if s.sampling_params.repetition_penalty != 1.0]
    if rep:
        rows = _index(rep, dev)
        seen = _token_counts([seqs[i].token_ids for i in rep], vocab, dev) > 0
        penalty = torch.tensor([seqs[i].sampling_params.repetition_penalty for i in rep],
                               device=dev)[:, None]
        x = logits[rows]
        # transformers' rule, over prompt and output: negative logits grow more negative, the others
        # shrink.
        logits[rows] = torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)
    pf = [
        i for i, s in enumerate(seqs)
        if (s.sampling_params.presence_penalty or s.sampling_params.frequency_penalty) and
        s.num_output_tokens
    ]
    if pf:
        rows = _index(pf, dev)
        counts = _token_counts([seqs[i].output_token_ids for i in pf], vocab, dev)
        presence = torch.tensor([seqs[i].sampling_params.presence_penalty for i in pf],
                                device=dev)[:, None]
        frequency = torch.tensor([seqs[i].sampling_params.frequency_penalty for i in pf],
                                 device=dev)[:, None]
        # OpenAI's rule, over generated tokens only.
        logits[rows] -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def _bad_word_tokens(bad_words_token_ids: list[list[int]], output: list[int]) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when the output so far ends with the word's
    other tokens (a one-token word is always banned)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def _mask_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> None:
    vocab, dev = logits.shape[-1], logits.device
    allowed = [i for i, s in enumerate(seqs) if s.sampling_params.allowed_token_ids is not None]
    if allowed:
        ids = [seqs[i].sampling_params.allowed_token_ids for i in allowed]
        blocked = torch.ones(len(allowed), vocab, dtype=torch.bool, device=dev)
        entry_rows = _index([r for r, row in enumerate(ids) for _ in row], dev)
        blocked[entry_rows, _index([t for row in ids for t in row], dev)] = False
        allowed_rows = _index(allowed, dev)
        logits[allowed_rows] = logits[allowed_rows].masked_fill(blocked, NEG_INF)
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        p = seq.sampling_params
        banned = _bad_word_tokens(seq.bad_words_token_ids,
                                  seq.output_token_ids) if seq.bad_words_token_ids else []
        if seq.num_output_tokens < p.min_tokens:
            banned += p.stop_token_ids + sorted(eos_token_ids)
        # an id past the head (a tokenizer's EOS) cannot be drawn anyway
        banned = [t for t in banned if t < vocab]
        rows += [i] * len(banned)
        cols += banned
    if rows:
        logits[_index(rows, dev), _index(cols, dev)] = NEG_INF


def process_logits(logits: torch.Tensor, seqs: list[Sequence],
                   eos_token_ids: set[int]) -> torch.Tensor:
    """Step 2 of the module docstring, in place on float32 logits [B, vocab]; returns them."""
    params = [s.sampling_params for s in seqs]
    _add_logit_bias(logits, params)
    _apply_penalties(logits, seqs)
    _mask_tokens(logits, seqs, eos_token_ids)
    _end_thinking(logits, seqs)
    return logits


def _end_thinking(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Step 2d: rows whose thinking budget is spent can only emit the end tag."""
    for i, seq in enumerate(seqs):
        if seq.reasoning is not None and seq.reasoning.must_end(seq.output_token_ids):
            logits[i] = NEG_INF
            logits[i, seq.reasoning.parser.end_token_id] = 0.0


def _top_k(x: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    # TopKLogitsWarper: drop what is below the k-th largest logit (ties with it stay). 0 is off: k =
    # vocab.
    k = torch.tensor([t if t > 0 else x.shape[-1] for t in top_k],
                     device=x.device).clamp_max(x.shape[-1])
    kth = x.topk(int(k.max()), -1).values.gather(1, (k - 1)[:, None])
    return x.masked_fill(x < kth, NEG_INF)


def _top_p(x: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    # TopPLogitsWarper, step for step: ascending order, drop a token while the mass up to and
    # including it is at most 1 - top_p, never the most likely one. Rows with top_p 1 are left
    # alone, as transformers does.
    sorted_x, order = x.sort(-1)
    cumulative = sorted_x.softmax(-1).cumsum(-1)
    threshold = torch.tensor([1 - t for t in top_p], dtype=x.dtype, device=x.device)[:, None]
    drop = (cumulative <= threshold) & torch.tensor([t < 1.0
                                                     for t in top_p], device=x.device)[:, None]
    drop[:, -1] = False
    return x.masked_fill(drop.scatter(1, order, drop), NEG_INF)


def _min_p(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    # MinPLogitsWarper: drop tokens less likely than min_p times the most likely one (which always
    # stays).
    probs = x.softmax(-1)
    floor = torch.tensor(min_p, dtype=x.dtype, device=x.device)[:, None] * probs.amax(
        -1, keepdim=True)
    return x.masked_fill(probs < floor, NEG_INF)


def warp_logits(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Step 3 of the module docstring on the processed logits of sampled rows [R, vocab] (params one
    per row)."""
    x = x / torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)[:, None]
    if any(p.top_k for p in params):
        x = _top_k(x, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        x = _top_p(x, [p.top_p for p in params])
    if any(p.min_p for p in params):
        x = _min_p(x, [p.min_p for p in params])
    return x


def _inverse_cdf(probs: torch.Tensor, cdf: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token where each row's CDF (probs.cumsum(-1)) first exceeds uniform * mass. Never a token
    of probability 0: searching for the first CDF value strictly greater than the draw skips them
    (the first one >= it would pick token 0 for a draw of 0, masked or not)."""
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    picked = picked.clamp_max(probs.shape[-1] - 1)
    # Summed in order, the CDF only steps at tokens with probability. Summed in another order (a
    # parallel scan on an accelerator), it can step by a rounding error at a masked token: such a
    # pick moves to the nearest token with probability before it (the first one if there is none).
    kept = probs > 0
    positions = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    kept_at_or_before = torch.where(kept, positions,
                                    -1).cummax(-1).values.gather(1, picked[:, None]).squeeze(1)
    return torch.where(kept_at_or_before >= 0, kept_at_or_before, kept.int().argmax(-1))


def logprob_entries(raw_logprobs: torch.Tensor, chosen: list[int], num_logprobs: list[int | None]):
    """Per row of raw logprobs [R, vocab] float32, {token: (logprob, rank)} of the num_logprobs[r]
    most likely tokens plus the chosen one (vLLM's shape; rank 1 is the most likely, ties share the
    better rank), or None where num_logprobs[r] is None (the request did not ask)."""
    asked = [r for r, k in enumerate(num_logprobs) if k is not None]
    entries = [None] * len(chosen)
    if not asked:
        return entries
    rows = _index(asked, raw_logprobs.device)
    picked = raw_logprobs[rows].gather(
        1,
        _index([chosen[r] for r in asked], raw_logprobs.device)[:, None])
    ranks = ((raw_logprobs[rows] > picked).sum(-1) + 1).tolist()
    top_k = max(num_logprobs[r] for r in asked)
    top = raw_logprobs[rows].topk(top_k) if top_k else None
    for j, r in enumerate(asked):
        entry = {}
        if num_logprobs[r]:
            ids, values = top.indices[j, :num_logprobs[r]].tolist(), top.values[
                j, :num_logprobs[r]].tolist()
            entry = {t: (v, rank) for rank, (t, v) in enumerate(zip(ids, values), 1)}
        if chosen[r] not in entry:
            entry[chosen[r]] = (picked[j, 0].item(), ranks[j])
        entries[r] = entry
    return entries


PROMPT_ROWS_PER_PASS = 256  # prompt logprobs: rows of [rows, vocab] float32 held at once


def prompt_logprob_entries(logits: torch.Tensor, next_tokens: list[int], num_logprobs: list[int]):
    """SamplingParams.prompt_logprobs: row r of logits [R, vocab] is the position before prompt
    token next_tokens[r]; its entry is that token's raw logprob and the num_logprobs[r] most likely
    (logprob_entries), in slices so a long prefill chunk never holds all its rows in float32 at
    once."""
    entries = []
    for lo in range(0, logits.shape[0], PROMPT_ROWS_PER_PASS):
        hi = lo + PROMPT_ROWS_PER_PASS
        raw = torch.log_softmax(logits[lo:hi].float(), -1)
        entries += logprob_entries(raw, next_tokens[lo:hi], num_logprobs[lo:hi])
    return entries


def _uniforms(seq: Sequence, count: int, device) -> torch.Tensor:
    """count uniforms in [0, 1) from the sequence's own generator: a seeded request draws the same
    tokens whatever shares its batch, at a cost of a few random numbers per sequence, not one per
    vocabulary entry."""
    return torch.rand(count, generator=seq.generator, device=device)


class _Proposed(PromptAndOutput):
    """A sequence as row j of its verification sees it: its tokens, then its first j proposed tokens
    (the penalties, bad words and min_tokens of that row count them as output)."""
    __slots__ = ("token_ids", "num_prompt_tokens", "sampling_params", "bad_words_token_ids",
                 "reasoning")

    def __init__(self, seq: Sequence, j: int):
        self.token_ids = seq.token_ids + seq.spec_token_ids[:j]
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.sampling_params = seq.sampling_params
        self.bad_words_token_ids = seq.bad_words_token_ids
        self.reasoning = seq.reasoning


def _verification_rows(seqs: list[Sequence]) -> tuple[list, list[int]]:
    """Each sequence's rows (itself, then one per proposed token) and the index of its first row."""
    if not any(seq.spec_token_ids for seq in seqs):
        return seqs, list(range(len(seqs)))
    rows, first = [], []
    for seq in seqs:
        first.append(len(rows))
        rows += [seq] + [_Proposed(seq, j) for j in range(1, len(seq.spec_token_ids) + 1)]
    return rows, first


def _draw(seqs: list[Sequence], rows: list, first: list[int], probs: torch.Tensor,
          random_rows: list[int]):
    """For the sampled rows: (accept, replacement). Row j < k of a sequence with k proposals accepts
    proposal d_j with probability p_j(d_j), else its replacement is drawn from p_j without d_j,
    renormalized: the modified rejection sampling of Leviathan et al. with a proposal of probability
    1 (n-gram and a greedy draft), whose output is distributed as p_j itself. A sequence's last row
    draws from p_k. Each sequence takes 2k + 1 uniforms from its own generator whatever the outcome
    (one, as without speculation, when k = 0)."""
    dev = probs.device
    where = {row: r for r, row in enumerate(random_rows)}
    uniform = torch.empty(len(random_rows), 2, device=dev)
    proposed = torch.zeros(len(random_rows), dtype=torch.long, device=dev)
    last_rows = []
    for seq, f in zip(seqs, first):
        if f not in where:
            continue
        k = len(seq.spec_token_ids)
        u = _uniforms(seq, 2 * k + 1, dev)
        for j in range(k):
            uniform[where[f + j]] = u[[j, k + j]]
            proposed[where[f + j]] = seq.spec_token_ids[j]
        uniform[where[f + k], 1] = u[2 * k]
        last_rows.append(where[f + k])
    residual = probs
    if len(last_rows) < len(random_rows):  # some rows verify a proposal
        accept = (uniform[:, 0] < probs.gather(1, proposed[:, None]).squeeze(1)).tolist()
        residual = probs.scatter(1, proposed[:, None], 0.0)
        last = _index(last_rows, dev)
        residual[last] = probs[last]  # a last row has no proposal: it draws from p_k itself
    else:
        accept = [False] * len(random_rows)
    return accept, _inverse_cdf(residual, residual.cumsum(-1), uniform[:, 1]).tolist()


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int],
           grammar_bitmask: tuple[list[int], torch.Tensor] | None = None,
           apply_token_bitmask=token_bitmask_reference.apply_token_bitmask):
    """logits [R, vocab]: per sequence 1 + len(seq.spec_token_ids) rows, its last token's, then one
    per proposed token (speculative decoding; engine/speculative/). Returns per sequence the tokens
    it emits and their {token: (logprob, rank)} entries (None where not asked): the proposals it
    accepts, then one token from the first rejecting row, or from the last row when all are
    accepted; without proposals, one token.

    Verification is exact: a greedy row accepts its proposal iff it is the row's arg-max (the output
    equals decoding without speculation); a sampled row follows _draw. Every row runs the chain of
    the module docstring on its own context. Float32 logits are processed in place (the runner's are
    a fresh tensor each step; a copy of [R, vocab] per step would cost more than all the rest here).
    grammar_bitmask: (sequence indices, int32 [len, ceil(vocab / 32)]) for constrained sequences
    (never speculated: one row each), applied by `apply_token_bitmask` (the engine passes its op
    table's)."""
    logits = logits.float()
    rows, first = _verification_rows(seqs)
    params = [r.sampling_params for r in rows]
    raw_logprobs = torch.log_softmax(logits, -1) if any(p.logprobs is not None
                                                        for p in params) else None
    if grammar_bitmask is not None:
        constrained, bitmask = grammar_bitmask
        apply_token_bitmask(logits, [first[i] for i in constrained], bitmask)
    logits = process_logits(logits, rows, eos_token_ids)
    best = logits.argmax(-1).tolist()
    random_rows = [r for r, p in enumerate(params) if not p.greedy]
    accept, drawn = {}, {}
    if random_rows:
        rows_t = _index(random_rows, logits.device)
        probs = warp_logits(logits[rows_t], [params[r] for r in random_rows]).softmax(-1)
        accepted, replacement = _draw(seqs, rows, first, probs, random_rows)
        accept, drawn = dict(zip(random_rows, accepted)), dict(zip(random_rows, replacement))
    token_lists, chosen_rows = [], []
    for seq, f in zip(seqs, first):
        tokens = []
        for j, proposal in enumerate(seq.spec_token_ids + [None]):
            row = f + j
            ok = proposal is not None and (accept[row] if row in accept else proposal == best[row])
            tokens.append(proposal if ok else drawn.get(row, best[row]))
            chosen_rows.append(row)
            if not ok:
                break
        token_lists.append(tokens)
    if raw_logprobs is None:
        return token_lists, [[None] * len(t) for t in token_lists]
    flat = logprob_entries(raw_logprobs[_index(chosen_rows, logits.device)],
                           [t for ts in token_lists for t in ts],
                           [params[r].logprobs for r in chosen_rows])
    entries, start = [], 0
    for tokens in token_lists:
        entries.append(flat[start:start + len(tokens)])
        start += len(tokens)
    return token_lists, entries
