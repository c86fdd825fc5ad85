"""Prompt lookup: the tokens that followed an earlier occurrence of the sequence's longest recurring
suffix."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int,
                  never: frozenset[int]) -> list[int]:
    """Up to k tokens: for n from max_n down to min_n, the last n tokens are searched earlier in
    token_ids (prompt and output alike); the latest occurrence followed by k tokens (else the latest
    one) proposes what followed it, cut before the first token of `never` (image and video
    placeholders, which only the input processor places). [] when no suffix recurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Windows starting at 0 .. total - n - 1: every occurrence but the suffix itself.
        windows = sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n:]).all(1))
        if len(hits):
            # in a repeating stretch the latest one is followed by too few
            whole = hits[hits + n + k <= total]
            start = int(whole[-1] if len(whole) else hits[-1]) + n
            proposal = tokens[start:start + k].tolist()
            for i, token in enumerate(proposal):
                if token in never:
                    return proposal[:i]
            return proposal
    return []
