"""Turns the logits of each sequence's last position into its next token, with vLLM's sampling options.

Order: raw logprobs are reported before any processing (as vLLM does), then penalties, min_tokens, temperature,
top-k, top-p, min-p. Randomness comes from each sequence's own generator, so a seeded request draws the same
tokens whatever else shares its batch."""
from __future__ import annotations

from typing import Protocol

import torch

from vlinfer.sampling_params import SamplingParams


class Sequence(Protocol):
    """What sampling reads of a sequence (vlinfer.engine.sequence.Sequence has it): layers do not import the
    engine."""
    sampling_params: SamplingParams
    token_ids: list[int]
    output_token_ids: list[int]
    num_output_tokens: int


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    p = seq.sampling_params
    if p.repetition_penalty != 1.0:
        # transformers' rule, over prompt and output: positive logits shrink, negative ones grow.
        ids = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
        scores = logits[ids]
        logits[ids] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        # OpenAI's rule, over generated tokens only.
        counts = torch.bincount(torch.tensor(seq.output_token_ids, device=logits.device),
                                minlength=logits.shape[-1])[:logits.shape[-1]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]):
    """logits [B, vocab] -> (token ids list[int], per-row {token: logprob} or None)."""
    logits = logits.float()
    params = [s.sampling_params for s in seqs]
    raw_logprobs = torch.log_softmax(logits, -1) if any(p.logprobs is not None for p in params) else None
    for i, (seq, p) in enumerate(zip(seqs, params)):
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            _apply_penalties(logits[i], seq)
        if seq.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
            if banned:
                logits[i, list(banned)] = float("-inf")
    tokens = logits.argmax(-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        x = logits[rows] / torch.tensor([params[i].temperature for i in random_rows], device=logits.device)[:, None]
        top_k = [params[i].top_k for i in random_rows]
        if any(top_k):
            k = torch.tensor([t if t > 0 else x.shape[-1] for t in top_k], device=x.device).clamp_max(x.shape[-1])
            kth = x.topk(int(k.max()), -1).values.gather(1, (k - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
        top_p = [params[i].top_p for i in random_rows]
        if any(t < 1.0 for t in top_p):
            sorted_x, order = x.sort(-1, descending=True)
            probs = sorted_x.softmax(-1)
            # Keep the smallest set whose mass reaches top_p: drop a token if the mass before it already does.
            drop = (probs.cumsum(-1) - probs) > torch.tensor(top_p, device=x.device)[:, None]
            x = x.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        min_p = [params[i].min_p for i in random_rows]
        probs = x.softmax(-1)
        if any(min_p):
            floor = torch.tensor(min_p, device=x.device)[:, None] * probs.max(-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        # Inverse-CDF sampling with one uniform draw per row from that row's own generator: a seeded request
        # draws the same tokens whatever shares its batch, and the cost is one random number, not one per token.
        uniform = torch.cat([torch.rand(1, generator=seqs[i].generator, device=probs.device) for i in random_rows])
        cdf = probs.cumsum(-1)
        picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).squeeze(1)
        tokens[rows] = picked.clamp_max(probs.shape[-1] - 1)
    token_list = tokens.tolist()
    logprobs = [None] * len(seqs)
    if raw_logprobs is not None:
        for i, p in enumerate(params):
            if p.logprobs is None:
                continue
            entry = {}
            if p.logprobs:
                top = raw_logprobs[i].topk(p.logprobs)
                entry = dict(zip(top.indices.tolist(), top.values.tolist()))
            entry[token_list[i]] = raw_logprobs[i, token_list[i]].item()
            logprobs[i] = entry
    return token_list, logprobs
