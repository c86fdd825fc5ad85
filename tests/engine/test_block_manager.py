"""BlockManager: paged allocation, reference counts, prefix caching by chained block hashes, and
eviction of cached free blocks. Pure Python, no model."""
import random

import pytest

from vlinfer.engine.block_manager import BlockManager, hash_block
from vlinfer.engine.sequence import Sequence
from vlinfer.inputs import MultiModalItem
from vlinfer.sampling_params import SamplingParams

HASH_BITS = 128  # hash_block returns a 16-byte digest


def seq_of(token_ids, mm_items=None) -> Sequence:
    return Sequence(list(token_ids), SamplingParams(), mm_items=mm_items)


def tokens(n, seed=0, vocab=50_000):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What one engine step does for seq: make room for n tokens, 'compute' them, register full
    blocks."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit seq the way the scheduler does (prefix hits first) and compute the rest of its tokens.
    """
    seq.num_computed_tokens = bm.allocate_prefix(seq)
    compute(bm, seq, seq.num_tokens - seq.num_computed_tokens)


def check_pool(bm: BlockManager) -> None:
    """Free pool holds exactly the blocks with ref_count 0; hash_to_block maps each hash to the one
    block carrying it, and every block that carries a hash is the one mapped (an identical copy
    stays unhashed)."""
    assert set(bm.free_blocks) == {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert all(b.ref_count >= 0 for b in bm.blocks)
    for h, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].hash == h
    hashed = [b for b in bm.blocks if b.hash is not None]
    assert len({b.hash for b in hashed}) == len(hashed), "two blocks carry the same hash"
    assert all(bm.hash_to_block.get(b.hash) == b.block_id
               for b in hashed), "a hashed block is unreachable"


# ------------------------------------------------------------------------------------------------
# allocation

def test_blocks_needed():
    bm = BlockManager(4, 16)
    assert [bm.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33, 40)] == [0, 1, 1, 1, 2, 2, 3, 3]


def test_allocate_grows_block_table_exactly_across_block_edges():
    bm = BlockManager(10, 4)
    seq = seq_of(range(10))
    grown = []
    for n in (3, 1, 1, 2, 3):  # computed 3, 4, 5, 7, 10
        assert bm.allocate(seq, n)
        seq.num_computed_tokens += n
        grown.append(len(seq.block_table))
        assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
    assert grown == [1, 1, 2, 2, 3]
    assert bm.allocate(seq, 0) and len(seq.block_table) == 3  # nothing new needed
    assert len(set(seq.block_table)) == 3
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert bm.num_free_blocks == 7
    check_pool(bm)


def test_allocate_several_blocks_at_once():
    bm = BlockManager(10, 16)
    seq = seq_of(range(40))
    assert bm.allocate(seq, 40)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7


def test_allocate_returns_false_and_allocates_nothing_when_pool_is_short():
    bm = BlockManager(3, 4)
    a = seq_of(range(8))
    assert bm.allocate(a, 8) and bm.num_free_blocks == 1
    b = seq_of(range(100, 108))
    assert not bm.can_allocate(b, 8)
    assert not bm.allocate(b, 8)  # needs 2, one free
    assert b.block_table == [] and bm.num_free_blocks == 1
    # A sequence that already holds blocks is not grown partially either.
    a.num_computed_tokens = 8
    table = list(a.block_table)
    assert not bm.allocate(a, 5)  # 13 tokens -> 4 blocks, holds 2, one free
    assert a.block_table == table and bm.num_free_blocks == 1
    assert bm.allocate(a, 4) and len(a.block_table) == 3 and bm.num_free_blocks == 0
    check_pool(bm)


# ---------------------------------------------------------------------------------------- reference
# counts

def test_shared_prefix_blocks_are_ref_counted_and_return_to_pool_only_at_zero():
    bm = BlockManager(8, 4)
    a = seq_of(range(12))
    prefill(bm, a)  # 3 full blocks, all cached
    b = seq_of(list(range(8)) + [500, 501])  # same first 2 blocks
    assert bm.allocate_prefix(b) == 8
    b.num_computed_tokens = 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    compute(bm, b, 2)
    assert b.block_table[2] not in a.block_table
    assert bm.num_free_blocks == 8 - 4
    check_pool(bm)

    shared, a_only = a.block_table[:2], a.block_table[2]
    bm.free(a)
    assert a.block_table == []
    assert [bm.blocks[x].ref_count for x in shared] == [1, 1]
    assert all(x not in bm.free_blocks for x in shared)  # still held by b
    assert bm.blocks[a_only].ref_count == 0 and a_only in bm.free_blocks
    check_pool(bm)

    bm.free(b)
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    assert bm.num_free_blocks == bm.num_blocks
    check_pool(bm)


def test_free_clears_table_so_a_second_free_is_a_no_op():
    bm = BlockManager(4, 4)
    a = seq_of(range(6))
    compute(bm, a, 6)
    bm.free(a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_double_free_of_a_block_raises():
    bm = BlockManager(4, 4)
    a = seq_of(range(6))
    compute(bm, a, 6)
    stale = list(a.block_table)
    bm.free(a)
    a.block_table = stale  # a stale table that still names the freed blocks
    # an error, not an assert `python -O` drops
    with pytest.raises(RuntimeError, match=r"KV block \d+ freed twice"):
        bm.free(a)
    assert all(blk.ref_count == 0 for blk in bm.blocks)  # refused before any count went negative


# ----------------------------------------------------------------------------------------- prefix
# hit / miss

def test_cache_full_blocks_registers_only_computed_full_blocks():
    bm = BlockManager(8, 16)
    a = seq_of(tokens(40))
    assert bm.allocate(a, 40)
    a.num_computed_tokens = 20
    bm.cache_full_blocks(a)
    assert len(bm.hash_to_block) == 1
    assert bm.blocks[a.block_table[0]].hash is not None and bm.blocks[a.block_table[1]].hash is None
    a.num_computed_tokens = 40
    bm.cache_full_blocks(a)
    assert len(bm.hash_to_block) == 2
    assert [bm.blocks[x].hash for x in a.block_table] == [*a.block_hashes[:2], None]
    assert bm.hash_to_block == {
        a.block_hashes[0]: a.block_table[0], a.block_hashes[1]: a.block_table[1]
    }
    check_pool(bm)


def test_prefix_hit_reuses_first_two_blocks_of_a_40_token_prompt():
    bm = BlockManager(8, 16)
    prompt = tokens(40, seed=1)
    a = seq_of(prompt)
    prefill(bm, a)
    b = seq_of(prompt[:32] + tokens(8, seed=2))  # same first two blocks, different partial tail
    assert bm.allocate_prefix(b) == 32
    assert b.block_table == a.block_table[:2]
    b.num_computed_tokens = 32
    compute(bm, b, 8)
    assert b.block_table[2] != a.block_table[2]
    same = seq_of(prompt)  # identical prompt: still 32, the partial last block is never cached
    assert bm.allocate_prefix(same) == 32
    assert same.block_table == a.block_table[:2]
    check_pool(bm)


def test_different_first_token_misses_everything():
    bm = BlockManager(8, 16)
    prompt = tokens(40, seed=3)
    prefill(bm, seq_of(prompt))
    other = seq_of([prompt[0] + 1] + prompt[1:])
    assert bm.allocate_prefix(other) == 0
    assert other.block_table == []
    # chained: no later block matches either
    assert not set(other.block_hashes) & set(bm.hash_to_block)
    check_pool(bm)


def test_fully_cached_prompt_recomputes_its_last_block_in_a_private_block():
    bm = BlockManager(8, 16)
    prompt = tokens(32, seed=4)
    a = seq_of(prompt)
    prefill(bm, a)
    b = seq_of(prompt)
    # The block holding the last token is not reused: the last token is recomputed for its logits,
    # and its KV must not be written into a block that `a` reads.
    assert bm.allocate_prefix(b) == 16
    assert b.block_table == a.block_table[:1]
    b.num_computed_tokens = 16
    free_before = bm.num_free_blocks
    assert bm.allocate(b, 16) and bm.num_free_blocks == free_before - 1
    assert b.block_table[1] != a.block_table[1]
    check_pool(bm)


def test_partial_last_block_is_cached_once_it_fills():
    bm = BlockManager(8, 4)
    a = seq_of(range(6))
    compute(bm, a, 6)  # prefill: blocks [0..3] full, [4, 5] partial
    assert bm.blocks[a.block_table[1]].hash is None
    assert len(bm.hash_to_block) == 1
    a.append_token(6)  # sampled
    compute(bm, a, 1)  # decode token 6: second block holds 3 of 4
    assert bm.blocks[a.block_table[1]].hash is None
    a.append_token(7)
    compute(bm, a, 1)  # decode token 7: the block is full and computed
    assert bm.blocks[a.block_table[1]].hash == a.block_hashes[1]
    assert len(bm.hash_to_block) == 2
    a.append_token(8)
    compute(bm, a, 1)  # token 8 opens a third block, partial again
    assert len(a.block_table) == 3 and bm.blocks[a.block_table[2]].hash is None
    b = seq_of(range(9))
    assert bm.allocate_prefix(b) == 8 and b.block_table == a.block_table[:2]
    check_pool(bm)


def test_prefix_hit_takes_blocks_out_of_the_free_pool():
    bm = BlockManager(4, 4)
    a = seq_of(range(8))
    prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq_of(range(10))
    assert bm.allocate_prefix(b) == 8
    assert bm.num_free_blocks == 2
    assert all(bm.blocks[x].ref_count == 1 for x in b.block_table)
    check_pool(bm)


# ------------------------------------------------------------------------------------------------
# hash chain

def test_hash_block_is_deterministic_and_depends_on_every_input():
    toks = list(range(16))
    h = hash_block(None, toks)
    assert h == hash_block(None, list(toks)) and isinstance(h, int)
    assert h != hash_block(None, toks[:-1] + [99])
    assert h != hash_block(123, toks)
    assert hash_block(1, toks) != hash_block(2, toks)
    assert h != hash_block(None, toks, (7,))
    assert hash_block(None, toks, (7,)) == hash_block(None, toks, (7,))
    assert hash_block(None, toks, (7,)) != hash_block(None, toks, (8,))
    assert hash_block(None, toks, (7, 8)) != hash_block(None, toks, (8, 7))


def test_same_block_tokens_after_different_parents_hash_differently():
    bm = BlockManager(8, 4)
    tail = [9, 9, 9, 9]
    a, b = seq_of([1, 2, 3, 4] + tail), seq_of([5, 6, 7, 8] + tail)
    ha, hb = bm.update_block_hashes(a), bm.update_block_hashes(b)
    assert len(ha) == len(hb) == 2
    assert ha[1] != hb[1]
    prefill(bm, a)
    c = seq_of([5, 6, 7, 8] + tail)
    assert bm.allocate_prefix(c) == 0


def test_hash_block_accepts_any_hash_it_returns_as_a_parent():
    """hash_block returns a 128-bit unsigned digest; chaining must work whatever its top bit is."""
    toks = list(range(16))
    big = next(h for h in (hash_block(None, [t] * 16) for t in range(200))
               if h >= 1 << (HASH_BITS - 1))
    assert 0 <= big < 1 << HASH_BITS
    child = hash_block(big, toks)  # the parent's top bit is set
    assert child == hash_block(big, toks) and child != hash_block(big - 1, toks)
    hash_block((1 << HASH_BITS) - 1, toks)


def test_update_block_hashes_for_a_long_prompt():
    """64 chained blocks: almost surely some parent hash has its top bit set."""
    bm = BlockManager(80, 16)
    seq = seq_of(tokens(64 * 16 + 5, seed=5))
    hashes = bm.update_block_hashes(seq)
    assert len(hashes) == 64 and len(set(hashes)) == 64
    assert bm.update_block_hashes(seq) is hashes and len(hashes) == 64  # idempotent


def test_long_prompt_prefix_hit():
    bm = BlockManager(80, 16)
    prompt = tokens(16 * 20 + 3, seed=6)
    a = seq_of(prompt)
    prefill(bm, a)
    b = seq_of(prompt[:16 * 12] + tokens(30, seed=7))
    assert bm.allocate_prefix(b) == 16 * 12
    assert b.block_table == a.block_table[:12]


def image(offset, length, content_hash):
    return MultiModalItem("image", offset, length, content_hash)


def test_mm_content_hash_in_block_1_shares_block_0_only():
    bm = BlockManager(16, 16)
    prompt = tokens(64, seed=8)  # 4 full blocks; placeholders at 20..27 sit in block 1
    a = seq_of(prompt, [image(20, 8, 0xDEADBEEF)])
    prefill(bm, a)
    b = seq_of(prompt, [image(20, 8, 0xFEEDFACE)])
    hb = bm.update_block_hashes(b)
    assert hb[0] == a.block_hashes[0]
    # block 1 differs, and so every later one
    assert all(hb[i] != a.block_hashes[i] for i in (1, 2, 3))
    assert bm.allocate_prefix(b) == 16
    assert b.block_table == a.block_table[:1]
    b.num_computed_tokens = 16
    compute(bm, b, 48)
    assert not set(b.block_table[1:]) & set(a.block_table)
    check_pool(bm)


def test_mm_same_content_hash_is_a_full_hit():
    bm = BlockManager(16, 16)
    # 4 full blocks + 1 token: the last token sits in a partial block of its own
    prompt = tokens(65, seed=9)
    big = (1 << 64) - 3  # image_content_hash is a 64-bit unsigned key
    a = seq_of(prompt, [image(20, 8, big)])
    prefill(bm, a)
    b = seq_of(prompt, [image(20, 8, big)])
    assert bm.update_block_hashes(b) == a.block_hashes
    assert bm.allocate_prefix(b) == 64  # every full block hits, the image block included
    assert b.block_table == a.block_table[:4]
    assert all(bm.blocks[x].ref_count == 2 for x in b.block_table)
    b.num_computed_tokens = 64
    compute(bm, b, 1)
    assert b.block_table[4] != a.block_table[4]  # the block with the last token is b's own
    check_pool(bm)


def test_mm_item_spanning_a_block_edge_keys_both_blocks():
    bm = BlockManager(16, 16)
    prompt = tokens(48, seed=10)
    a = seq_of(prompt, [image(10, 10, 1)])  # 10..19: blocks 0 and 1
    b = seq_of(prompt, [image(10, 10, 2)])
    assert a.mm_hashes_in(0, 16) == (1, ) and a.mm_hashes_in(16, 32) == (1, ) and a.mm_hashes_in(
        32, 48) == ()
    prefill(bm, a)
    assert bm.allocate_prefix(b) == 0


def test_mm_items_do_not_change_hashes_of_blocks_they_do_not_touch():
    bm = BlockManager(16, 16)
    prompt = tokens(48, seed=11)
    plain = bm.update_block_hashes(seq_of(prompt))
    with_image = bm.update_block_hashes(seq_of(prompt, [image(32, 16, 5)]))  # block 2 only
    assert with_image[:2] == plain[:2] and with_image[2] != plain[2]


# --------------------------------------------------------------------------------------------------
# eviction

def test_freed_cached_blocks_stay_findable_and_unhashed_are_reused_first():
    bm = BlockManager(4, 4)
    a = seq_of(range(10))  # 2 full (cached) blocks + 1 partial (unhashed)
    prefill(bm, a)
    cached, partial = a.block_table[:2], a.block_table[2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    c = seq_of(range(100, 108))
    compute(bm, c, 8)  # 2 blocks: the never-used one and a's unhashed one, not the cached pair
    assert set(c.block_table) == set(range(4)) - set(cached)
    assert partial in c.block_table
    assert all(bm.blocks[x].hash is not None for x in cached)
    b = seq_of(range(10))
    assert bm.allocate_prefix(b) == 8 and b.block_table == cached
    check_pool(bm)


def test_unhashed_freed_block_is_reused_before_older_cached_ones():
    bm = BlockManager(3, 4)
    a = seq_of(range(8))  # 2 full blocks, cached
    prefill(bm, a)
    d = seq_of(range(100, 102))  # a partial block, never cached
    compute(bm, d, 2)
    assert bm.num_free_blocks == 0
    bm.free(a)  # cached blocks freed first...
    bm.free(d)  # ...the unhashed one last, yet it is handed out first
    e = seq_of(range(200, 203))
    compute(bm, e, 3)
    assert e.block_table == [2]
    f = seq_of(range(9))  # one token past a's blocks, so both full blocks can hit
    assert bm.allocate_prefix(f) == 8 and f.block_table == [0, 1]
    check_pool(bm)


def test_identical_block_computed_alongside_a_cached_one_stays_unhashed_and_is_reused_first():
    bm = BlockManager(6, 4)
    a, b = seq_of(range(9)), seq_of(range(9))
    # Both admitted in one step, before either has computed anything: no hits, each gets its own
    # blocks.
    assert bm.allocate_prefix(a) == 0 and bm.allocate_prefix(b) == 0
    assert bm.allocate(a, 9) and bm.allocate(b, 9)
    assert not set(a.block_table) & set(b.block_table)
    a.num_computed_tokens = b.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2
    assert [bm.blocks[x].hash for x in a.block_table] == [*a.block_hashes, None]
    # copies of cached blocks: left unhashed
    assert all(bm.blocks[x].hash is None for x in b.block_table)
    assert bm.hash_to_block == dict(zip(a.block_hashes, a.block_table))
    bm.cache_full_blocks(b)  # registering again changes nothing
    assert all(bm.blocks[x].hash is None for x in b.block_table)
    check_pool(bm)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # the cached blocks are freed first...
    bm.free(b)  # ...b's copies last, yet they are plain free space and are handed out first
    assert bm.num_free_blocks == 6
    c = seq_of(range(100, 116))
    compute(bm, c, 16)  # 4 blocks: b's 3 and a's unhashed partial one, not a's cached pair
    assert set(c.block_table) == set(b_blocks) | {a_blocks[2]}
    assert all(h in bm.hash_to_block for h in a.block_hashes)
    d = seq_of(range(9))
    assert bm.allocate_prefix(d) == 8 and d.block_table == a_blocks[:2]
    check_pool(bm)


def test_cached_free_blocks_are_evicted_when_the_pool_needs_them():
    bm = BlockManager(4, 4)
    a = seq_of(range(8))
    prefill(bm, a)
    bm.free(a)
    c = seq_of(range(100, 116))
    compute(bm, c, 16)  # takes every block, evicting a's
    assert bm.num_free_blocks == 0
    assert not set(a.block_hashes) & set(bm.hash_to_block)
    bm.free(c)
    b = seq_of(range(8))
    assert bm.allocate_prefix(b) == 0 and b.block_table == []
    check_pool(bm)


def test_lru_least_recently_freed_cached_block_is_evicted_first():
    bm = BlockManager(6, 4)
    a, b = seq_of(range(8)), seq_of(range(100, 108))
    prefill(bm, a)
    prefill(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # a is freed first: least recently used
    bm.free(b)
    c = seq_of(range(200, 212))
    compute(bm, c, 12)  # 2 never-used blocks, then one eviction
    evicted = c.block_table[2]
    assert evicted == a_blocks[1]  # a's tail goes first: its head is still useful on its own
    assert bm.blocks[evicted].hash is not None  # c's own full block now
    assert a.block_hashes[1] not in bm.hash_to_block  # the evicted block's hash no longer hits
    assert a.block_hashes[0] in bm.hash_to_block and all(h in bm.hash_to_block
                                                         for h in b.block_hashes)
    # One token past two blocks, so a hit on the second block is possible: only b's still exists.
    a2 = seq_of(range(9))
    assert bm.allocate_prefix(a2) == 4 and a2.block_table == a_blocks[:1]
    b2 = seq_of(range(100, 109))
    assert bm.allocate_prefix(b2) == 8 and b2.block_table == b_blocks
    check_pool(bm)


def test_lru_a_prefix_hit_refreshes_a_cached_block():
    bm = BlockManager(4, 4)
    a, b = seq_of(range(4)), seq_of(range(100, 104))
    prefill(bm, a)
    prefill(bm, b)
    a_block, b_block = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    a2 = seq_of(range(5))  # hits a's block: a becomes the most recently used
    prefill(bm, a2)
    assert a2.block_table[0] == a_block
    bm.free(a2)
    c = seq_of(range(200, 212))
    compute(bm, c, 12)  # 2 unhashed-or-unused, then the least recently used cached block: b's
    assert b_block in c.block_table and a_block not in c.block_table
    assert bm.allocate_prefix(seq_of(range(5))) == 4


# ------------------------------------------------------------------------------------- prefix
# caching disabled

def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = seq_of(range(12))
    prefill(bm, a)
    assert bm.hash_to_block == {} and all(blk.hash is None for blk in bm.blocks)
    b = seq_of(range(12))
    assert bm.allocate_prefix(b) == 0 and b.block_table == []
    bm.free(a)
    assert bm.allocate_prefix(b) == 0 and b.block_table == []
    compute(bm, b, 12)
    bm.free(b)
    assert bm.num_free_blocks == 8
    check_pool(bm)


def test_state_slots_go_with_the_blocks():
    """A hybrid model's state slot: taken with a sequence's first blocks, kept while it grows,
    given back with its blocks; with none free, allocate takes nothing."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, num_state_slots=2)
    a, b, c = seq_of(tokens(6, 1)), seq_of(tokens(6, 2)), seq_of(tokens(6, 3))
    compute(bm, a, 6)
    compute(bm, b, 6)
    assert (a.state_slot, b.state_slot) == (0, 1) and bm.num_free_slots == 0
    assert bm.allocate(a, 3) and a.state_slot == 0  # growing keeps its slot
    assert not bm.allocate(c, 6)
    assert c.block_table == [] and c.state_slot is None
    bm.free(b)
    assert b.state_slot is None and bm.num_free_slots == 1
    assert bm.allocate(c, 6) and c.state_slot == 1
    bm.free(a)
    bm.free(c)
    assert bm.num_free_slots == 2 and bm.num_free_blocks == 8
    plain = BlockManager(num_blocks=2, block_size=4)  # a pure-attention model holds no slots
    d = seq_of(tokens(3, 4))
    assert plain.allocate(d, 3) and d.state_slot is None
