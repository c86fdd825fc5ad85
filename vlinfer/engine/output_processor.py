"""Outputs out: each sampled token is appended to its sequence, detokenized incrementally, checked
against the request's stops, length and grammar, and turned into a RequestOutput with this step's
delta."""
import dataclasses
import logging
import math
import time

from vlinfer.engine.detokenizer import IncrementalDetokenizer
from vlinfer.engine.sequence import Sequence
from vlinfer.outputs import CompletionOutput, Logprob, RequestOutput
from vlinfer.structured.matchers import GrammarMatchers

logger = logging.getLogger("vlinfer")


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len  # the resolved one (engine/sizing.py)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # by sequence request_id

    def add(self, seq: Sequence) -> None:
        if seq.pooling_params is not None:  # pooling requests produce no text
            return
        p = seq.sampling_params
        self.detokenizers[seq.request_id] = IncrementalDetokenizer(self.tokenizer,
                                                                   seq.num_prompt_tokens,
                                                                   p.skip_special_tokens,
                                                                   p.spaces_between_special_tokens)

    def remove(self, seq: Sequence) -> None:
        self.detokenizers.pop(seq.request_id, None)

    def add_prompt_logprob(self, seq: Sequence, position: int, entry: dict) -> None:
        seq.prompt_logprobs[position] = self._logprobs(entry)

    def _logprobs(self, entry: dict) -> dict:
        """{token: (logprob, rank)} from the sampler -> {token: Logprob} with each token's text."""
        return {t: Logprob(lp, rank, self.tokenizer.decode([t])) for t, (lp, rank) in entry.items()}

    def append_tokens(self, seq: Sequence, token_ids: list[int], logprobs: list) -> RequestOutput:
        """Append a step's tokens (one, or accepted proposals and one more under speculative
        decoding) in order, up to the first that ends the request (seq.finish_reason is then set;
        the rest are dropped): one output whose delta is all of them."""
        appended = []
        for token_id, entry in zip(token_ids, logprobs):
            self._append_token(seq, token_id, entry)
            appended.append(token_id)
            if seq.finish_reason is not None:
                break
        finished = seq.finish_reason is not None
        p = seq.sampling_params
        # While streaming, hold back text that could still turn out to be the start of a stop string
        # (unless the stop string is output too: then everything before its end is final).
        hold = 0 if finished or not p.stop_strings or p.include_stop_str_in_output else \
            max(map(len, p.stop_strings)) - 1
        visible = max(len(seq.output_text) - hold, seq.num_streamed_chars)
        delta = seq.output_text[seq.num_streamed_chars:visible]
        delta_reasoning = ""
        if seq.reasoning is not None:  # the parser splits what is final, so streams split exactly
            delta_reasoning, delta = seq.reasoning.text.feed(delta, final=finished)
        out = make_output(seq, finished)
        out.outputs[0].delta_text = delta
        out.outputs[0].delta_reasoning = delta_reasoning
        out.outputs[0].delta_token_ids = appended
        seq.num_streamed_chars = visible
        return out

    def _append_token(self, seq: Sequence, token_id: int, logprobs) -> None:
        """Append one token; sets seq.finish_reason when it ends the request."""
        p = seq.sampling_params
        seq.append_token(token_id)
        metrics = seq.metrics
        metrics.last_token_time = time.time()
        if metrics.first_token_time is None:
            metrics.first_token_time = metrics.last_token_time
        if logprobs is not None:
            seq.output_logprobs.append(self._logprobs(logprobs))
            seq.cumulative_logprob += logprobs[token_id][0]
        grammar_error = None
        matcher = seq.grammar_matcher
        if seq.reasoning is not None:  # parked while thinking: the tags never reach the grammar
            seq.grammar_matcher = seq.reasoning.on_token(token_id, matcher)
        if matcher is not None and seq.grammar_matcher is matcher:
            grammar_error = GrammarMatchers.accept(matcher, token_id)
        sent = len(seq.output_text)
        # The sampler masks EOS and stop tokens until min_tokens, so one seen here past that point
        # ends the request.
        is_stop_token = token_id in p.stop_token_ids or (token_id in self.eos_token_ids and
                                                         not p.ignore_eos)
        stops = is_stop_token and seq.num_output_tokens > p.min_tokens
        # vLLM leaves a stop token's text out unless asked for it
        if not stops or p.include_stop_str_in_output:
            seq.output_text += self.detokenizers[seq.request_id].step(seq.token_ids)
        if stops:
            seq.finish_reason = "stop"
            seq.stop_reason = token_id if token_id in p.stop_token_ids else None
        longest_stop = max(map(len, p.stop_strings), default=0)
        if seq.finish_reason is None and p.stop_strings and seq.num_output_tokens >= p.min_tokens:
            self._check_stop_strings(seq, sent, longest_stop)
        # max_tokens None: until the context ends (vLLM's meaning)
        if seq.finish_reason is None and (seq.num_output_tokens >= (p.max_tokens or math.inf) or
                                          seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is None and seq.deadline is not None and \
                time.perf_counter() >= seq.deadline:  # cut short, as max_tokens cuts: "length"
            logger.warning("request %s: its time limit (--request-timeout) ran out after %d "
                           "tokens; finished as 'length'", seq.request_id, seq.num_output_tokens)
            seq.finish_reason = "length"
        if seq.finish_reason is None and grammar_error is not None:
            # Only when other options (allowed_token_ids, bad_words, min_tokens) left the grammar no
            # token: the output can no longer follow the constraint, so it ends here rather than run
            # on unconstrained.
            logger.warning(
                "request %s: its structured output constraint refused token %d (%s); aborted",
                seq.request_id, token_id, grammar_error)
            seq.finish_reason = "abort"
        if seq.finish_reason is not None:
            metrics.finished_time = metrics.last_token_time

    @staticmethod
    def _check_stop_strings(seq: Sequence, sent: int, longest_stop: int) -> None:
        """Only text near the new piece (from `sent` on) can complete a stop string."""
        p = seq.sampling_params
        window_start = max(0, sent - longest_stop)
        window = seq.output_text[window_start:]
        hits = [(window.find(s), s) for s in p.stop_strings if s in window]
        if hits:
            index, stop = min(hits)
            end = window_start + index + (len(stop) if p.include_stop_str_in_output else 0)
            seq.output_text = seq.output_text[:end]
            seq.finish_reason, seq.stop_reason = "stop", stop


def make_output(seq: Sequence, finished: bool) -> RequestOutput:
    asked = seq.sampling_params.logprobs is not None
    split = seq.reasoning.text if seq.reasoning is not None else None
    completion = CompletionOutput(index=seq.index,
                                  text=seq.output_text if split is None else split.content,
                                  reasoning=split.reasoning if split and split.opened else None,
                                  token_ids=seq.output_token_ids, finish_reason=seq.finish_reason,
                                  stop_reason=seq.stop_reason,
                                  logprobs=list(seq.output_logprobs) if asked else None,
                                  cumulative_logprob=seq.cumulative_logprob if asked else None)
    # A copy, as the logprobs list: a streamed output keeps the times it was made with.
    metrics = dataclasses.replace(seq.metrics)
    return RequestOutput(
        request_id=seq.parent_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
        outputs=[completion], finished=finished, num_cached_tokens=seq.num_cached_tokens,
        images=seq.images_info, videos=seq.videos_info, metrics=metrics,
        prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None)
