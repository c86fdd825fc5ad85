"""Builders and constants of tests/engine/test_hybrid_prefix_cache.py that other test modules use
too (prefill_logits): imported from here by every one of them, that module included."""
import torch


def prefill_logits(engine, prompt, tamper=None):
    """Prefill `prompt` (token ids or a request) alone through the scheduler (its prefix hit, chunk
    cuts and state copies included), the logits of every position it computes; then abort it.
    tamper(batch) may change each step's batch first. Returns (logits of positions
    num_cached_tokens.., the sequence)."""
    request = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    seq = engine.make_sequence(request)
    engine.add_sequence(seq)
    rows = []
    while seq.num_computed_tokens < seq.num_tokens:
        batch = engine.scheduler.schedule()
        assert batch.seqs == [seq]
        if tamper is not None:
            tamper(batch)
        rows.append(engine.model_runner.prompt_logits(batch))
        engine.scheduler.update(batch, [])
    engine.abort_request(seq.request_id)
    return torch.cat(rows), seq
