"""Checks on an engine's state after a run."""


def assert_block_pool_empty(llm):
    """Nothing left after a run: every KV block free, no request or scheduled sequence, no encoder
    cache entry."""
    assert len(llm.engine.model_runner.encoder_cache) == 0, "encoder cache entries left"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, \
        f"{bm.num_blocks - bm.num_free_blocks} KV blocks still in use"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()
