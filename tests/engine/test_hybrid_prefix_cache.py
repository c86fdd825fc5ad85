"""Prefix caching on hybrid models (docs/hybrid.md "Prefix caching"): the linear layers' state
checkpointed at block boundaries, a hit restoring the longest checkpointed prefix, against
transformers in float32 on tiny random Qwen3.5 text and Qwen3-Next checkpoints (the ones
tests/models/test_qwen3_5_text.py builds). A request sharing a block-aligned and a non-aligned
prefix with a finished one hits (the hit length from its num_cached_tokens) and its logits and
greedy tokens are transformers'; restoring the checkpoint of the wrong boundary, or skipping the
copy, fails the same check; n > 1 siblings hit the first one's checkpoint and equal separate runs;
chunked prefill, prefix hits and preemption together; nothing held but checkpoints after, and reset
frees them."""
import pytest
import torch

from engine_checks import assert_block_pool_empty
from vlinfer import LLM, SamplingParams
from vlinfer.toy.tiny_checkpoints import _rescale
from qwen3_5_text_cases import qwen3_next_config, save, text_config
from hybrid_prefix_cache_cases import prefill_logits

BS = 16
NUM_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
# 70 tokens; B shares its first 69 (four whole blocks, then five tokens), then goes its own way
FIRST = [(11 * i + 5) % 500 + 3 for i in range(70)]
SECOND = FIRST[:69] + [(13 * i + 1) % 500 + 3 for i in range(20)]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    """(transformers model, folder)."""
    import transformers
    if request.param == "qwen3_5":
        config, cls = text_config(), transformers.Qwen3_5ForCausalLM
    else:
        config, cls = qwen3_next_config(), transformers.Qwen3NextForCausalLM
    with torch.random.fork_rng(devices=[]):
        model = cls(config).eval()
    _rescale(model, torch.Generator().manual_seed(4))
    if request.param == "qwen3_next":
        model.set_experts_implementation("eager")
    model.generation_config.eos_token_id = None  # as ignore_eos
    return model, save(model, str(tmp_path_factory.mktemp(request.param)))


def hf(model, ids, num_new=NUM_NEW):
    """transformers' prompt logits and greedy tokens."""
    ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
        out = model.generate(ids, max_new_tokens=num_new, do_sample=False)
    return logits, out[0, ids.shape[1]:].tolist()


def make_llm(folder, **kw):
    kw.setdefault("kv_cache_bytes", 16 * 2 ** 20)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    return LLM(folder, dtype="float32", kvcache_block_size=BS, **kw)


def relative_error(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def assert_idle(llm):
    """No live sequence holds anything; the checkpoints are the only state kept, and reset frees
    them."""
    assert_block_pool_empty(llm)
    bm = llm.engine.block_manager
    assert bm.num_free_slots == bm.num_state_slots > 0
    held = list(bm.checkpoints.values())
    assert sorted(held + bm.free_checkpoints) == list(
        range(bm.num_state_slots, bm.num_state_slots + bm.num_checkpoint_slots))
    assert all(h in bm.hash_to_block for h in bm.checkpoints)
    assert not bm.pending_saves
    assert llm.reset_prefix_cache()
    assert not bm.checkpoints and len(bm.free_checkpoints) == bm.num_checkpoint_slots


def test_hit_restores_the_checkpoint_exactly(checkpoint):
    model, folder = checkpoint
    llm = make_llm(folder)
    engine, bm = llm.engine, llm.engine.block_manager
    assert engine.resolved.enable_prefix_caching and engine.resolved.num_checkpoint_slots == 8
    first_logits, first_tokens = hf(model, FIRST)
    second_logits, second_tokens = hf(model, SECOND)
    out = llm.generate([{"prompt_token_ids": FIRST}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == first_tokens
    # its prefill was cut at 64, the last boundary before its last token: checkpointed there
    assert len(bm.checkpoints) == 1
    ours, seq = prefill_logits(engine, SECOND)
    assert seq.num_cached_tokens == 64
    assert relative_error(ours, second_logits[64:]) < 1e-4
    # that prefill was cut at 80 and checkpointed there: SECOND again starts from 80
    out = llm.generate([{"prompt_token_ids": SECOND}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 80 and out.outputs[0].token_ids == second_tokens
    # a prompt equal to FIRST hits all but its tail past 64 and generates FIRST's tokens
    out = llm.generate([{"prompt_token_ids": FIRST}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == first_tokens
    assert_idle(llm)


def test_a_wrong_or_missing_state_fails_the_check(checkpoint):
    """Negative controls of the check above: the KV blocks hit, but the linear layers start from
    the checkpoint of another boundary (32 instead of 64), or from whatever the slot held (the
    restore skipped)."""
    model, folder = checkpoint
    second_logits, _ = hf(model, SECOND, 1)
    # chunks of 32: FIRST is checkpointed at 32 and 64
    llm = make_llm(folder, max_num_batched_tokens=32)
    engine, bm = llm.engine, llm.engine.block_manager

    def run(tamper):
        assert llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": FIRST}], GREEDY, use_tqdm=False)
        assert len(bm.checkpoints) == 2
        ours, seq = prefill_logits(engine, SECOND, tamper)
        assert seq.num_cached_tokens == 64
        return relative_error(ours, second_logits[64:])

    def wrong_boundary(batch):
        at_32, at_64 = list(bm.checkpoints.values())[:2]  # least recently used first
        assert batch.state_restores in ([], [(at_64, batch.seqs[0].state_slot)])
        batch.state_restores = [(at_32, dst) for _, dst in batch.state_restores]

    def skipped(batch):
        batch.state_restores = []

    assert run(None) < 1e-4
    assert run(wrong_boundary) > 1e-2
    assert run(skipped) > 1e-2


def test_n_siblings_hit_the_first_and_equal_separate_runs(checkpoint):
    model, folder = checkpoint
    _, tokens = hf(model, SECOND)
    llm = make_llm(folder)
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": SECOND},
                                    SamplingParams(n=3, temperature=0, max_tokens=NUM_NEW,
                                                   ignore_eos=True))
    siblings = [engine.requests[f"{request_id}#{i}"] for i in range(3)]
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.output_token_ids for s in siblings] == [tokens] * 3
    # the first prefilled, the others hit its checkpoint at 80 (the last boundary before 89)
    assert [s.num_cached_tokens for s in siblings] == [0, 80, 80]
    # seeded: each completion equals its own run on an engine without prefix caching
    seeded = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=NUM_NEW, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": SECOND}], seeded, use_tqdm=False)[0]
    plain = make_llm(folder, enable_prefix_caching=False)
    assert plain.engine.resolved.num_checkpoint_slots == 0
    theirs = plain.generate([{"prompt_token_ids": SECOND}], seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in ours.outputs] == [c.token_ids for c in theirs.outputs]
    assert_idle(llm)


def test_chunked_prefill_prefix_hits_and_preemption_together(checkpoint):
    """Four requests sharing a 40-token prefix on a pool that cannot hold them all, prefilled in
    chunks of 16: later ones hit earlier ones' checkpoints, some are preempted (their state dropped,
    rebuilt from a checkpoint or from scratch), and each generates transformers' tokens."""
    model, folder = checkpoint
    shared = FIRST[:40]
    prompts = [shared + [(17 * i + 7 * k) % 500 + 3 for i in range(12 + 5 * k)] for k in range(4)]
    num_new = 40
    expected = [hf(model, p, num_new)[1] for p in prompts]
    probe = make_llm(folder)
    pool = probe.engine.model_runner.cache_pool
    # 7 blocks for one sequence of max_model_len, 4 live slots and room for 2 checkpoints
    budget = 7 * pool.bytes_per_block + 8 * pool.bytes_per_slot
    llm = make_llm(folder, kv_cache_bytes=budget, max_model_len=112, max_num_seqs=4,
                   max_num_batched_tokens=16)
    resolved = llm.engine.resolved
    assert resolved.num_state_slots == 4 and resolved.num_checkpoint_slots == 2
    assert resolved.num_blocks * BS < sum(len(p) + num_new for p in prompts)
    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens >= 32 for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_idle(llm)


def test_a_budget_without_room_for_a_checkpoint_turns_prefix_caching_off(checkpoint, caplog):
    _, folder = checkpoint
    probe = make_llm(folder)
    pool = probe.engine.model_runner.cache_pool
    budget = 7 * pool.bytes_per_block + 4 * pool.bytes_per_slot
    with caplog.at_level("WARNING", logger="vlinfer"):
        llm = make_llm(folder, kv_cache_bytes=budget, max_model_len=112, max_num_seqs=4)
    assert llm.engine.resolved.num_checkpoint_slots == 0
    assert not llm.engine.resolved.enable_prefix_caching
    assert "holds no state checkpoint" in caplog.text


def test_checkpoint_bookkeeping_without_a_model():
    """The scheduler and block manager alone: chunks cut at block boundaries, a save reserved per
    boundary and keyed at the update, a hit cut to the last checkpoint, the LRU making room, and a
    checkpoint dropped with its evicted block."""
    from vlinfer.engine.block_manager import BlockManager
    from vlinfer.engine.scheduler import Scheduler
    from vlinfer.engine.sequence import Sequence

    bm = BlockManager(num_blocks=12, block_size=4, num_state_slots=2, num_checkpoint_slots=2)
    scheduler = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=6)

    def run(seq):
        """Prefill seq; the chunks each step ran and the saves it took."""
        scheduler.add(seq)
        chunks = []
        while seq.num_computed_tokens < seq.num_tokens:
            batch = scheduler.schedule()
            chunks.append((batch.num_new_tokens[0], batch.state_restores, batch.state_saves))
            scheduler.update(batch, [])
        scheduler.finish(seq)
        return chunks

    a = Sequence(list(range(3, 14)), None)  # 11 tokens: boundaries 4 and 8 before its last
    assert run(a) == [(4, [], [(0, 2)]), (4, [], [(0, 3)]), (3, [], [])]
    assert list(bm.checkpoints.values()) == [2, 3]
    b = Sequence(list(range(3, 12)) + [99, 98], None)  # shares 9 tokens: blocks 0 and 1
    assert run(b) == [(3, [(3, 0)], [])] and b.num_cached_tokens == 8
    c = Sequence(list(range(3, 7)) + [50, 51, 52, 53, 54], None)  # shares block 0
    # its hit touched block 0's checkpoint: its save at 8 takes the least recently used, block 1's
    assert run(c) == [(4, [(2, 0)], [(0, 3)]), (1, [], [])] and c.num_cached_tokens == 4
    again = Sequence(list(range(3, 14)), None)  # a's blocks 0 and 1 are cached, one checkpoint
    assert run(again)[0][:2] == (4, [(2, 0)]) and again.num_cached_tokens == 4
    assert bm.num_free_slots == 2 and len(bm.checkpoints) == 2
    # a long sequence takes every block: the cached ones are evicted, their checkpoints with them
    d = Sequence(list(range(200, 247)), None)
    scheduler.add(d)
    while d.num_computed_tokens < d.num_tokens:
        scheduler.update(scheduler.schedule(), [])
    assert len(bm.checkpoints) == 2 and set(bm.checkpoints) <= set(d.block_hashes)
    assert not set(bm.checkpoints.values()) & {0, 1}
    scheduler.finish(d)
    assert bm.reset_prefix_cache() and sorted(bm.free_checkpoints) == [2, 3]
