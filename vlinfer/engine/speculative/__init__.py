"""Speculative decoding: proposals (ngram.py: the sequence's own n-grams; draft_model.py: a smaller
model; the target checkpoint's MTP head, run by engine/mtp_head.py) verified by the target
model in one forward of k + 1 tokens per sequence (engine/sampler.py), under the rules of
speculator.py."""
from vlinfer.engine.speculative.draft_model import DraftModel
from vlinfer.engine.speculative.speculator import Speculator, placeholder_token_ids

__all__ = ["DraftModel", "Speculator", "placeholder_token_ids"]
