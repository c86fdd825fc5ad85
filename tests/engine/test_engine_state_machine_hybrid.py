"""The engine state machine (tests/engine/test_engine_state_machine.py's rules) on a hybrid model (a
tiny random Qwen3.5 text checkpoint: Gated DeltaNet layers beside gated attention), on a pool that
preempts and on a budget that chunks prefills. Beside the block checks, after every rule: each live
sequence holding blocks holds one state slot of its own (never shared between live sequences), a
sequence without blocks holds none, and the free slots are exactly the others; with prefix caching
(docs/hybrid.md), checkpoint slots are never a live sequence's, each is either free or keyed by a
block hash whose KV is cached; every finished request's tokens equal its run alone (without
speculation, on one engine with n-gram and one with MTP proposals); once idle, every slot is free
and only checkpoints are kept, which a reset frees."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from vlinfer import LLM, SamplingParams
from vlinfer.engine.drive import drive
from vlinfer.toy.mtp_heads import TorchMTP, save_mtp
from vlinfer.toy.tiny_checkpoints import _rescale
from engine_state_machine_cases import EngineMachine, Engines
from qwen3_5_text_cases import save, text_config

EXAMPLES, STEPS = 12, 30
MAX_NUM_SEQS = 4
# 6 blocks of 16 tokens beside the slots (preemption, no room for a checkpoint: prefix caching
# off); a budget of 8 tokens a step (chunks, checkpoints at their block boundaries); a tight pool
# with two checkpoints (prefix hits restoring states beside preemption)
ENGINES = {"tight-pool": dict(max_model_len=96, blocks=6),
           "chunked": dict(max_num_batched_tokens=8, max_model_len=128),
           "tight-prefix": dict(max_model_len=96, blocks=6, checkpoints=2),
           # n-gram speculation on the tight pool with checkpoints: rejections put states back
           # beside preemption and prefix hits (docs/speculative.md "Hybrid targets")
           "speculating": dict(max_model_len=96, blocks=6, checkpoints=2, speculative_config={
               "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
               "prompt_lookup_max": 2, "adaptive": False}),
           # the checkpoint's MTP head (docs/speculative.md "MTP"): its K and V in the same
           # blocks, its kept hidden state in the same slots, freed with them
           "mtp": dict(max_model_len=96, blocks=6, checkpoints=2, speculative_config={
               "method": "mtp", "num_speculative_tokens": 3, "adaptive": False})}


class HybridEngines:
    def __init__(self, folder):
        from transformers import Qwen3_5ForCausalLM
        with torch.random.fork_rng(devices=[]):
            model = Qwen3_5ForCausalLM(text_config(max_position_embeddings=512)).eval()
        _rescale(model, torch.Generator().manual_seed(3))
        self.path = save(model, str(folder))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            save_mtp(self.path, TorchMTP(model))  # read by the "mtp" engine only
        self.reference = LLM(self.path, dtype="float32", kv_cache_bytes=16 * 2 ** 20)
        self.engines, self.alone = {}, {}
        self.stats = dict(examples=0, requests=0, aborted=0, refused=0, steps=0, compared=0)

    def engine(self, name):
        if name not in self.engines:
            options = dict(ENGINES[name])
            blocks = options.pop("blocks", None)
            # sizing.py gives checkpoints half of what the live slots leave beside one sequence
            slots = MAX_NUM_SEQS + 2 * options.pop("checkpoints", 0)
            # the pool's costs with this engine's speculation (an MTP head adds a KV layer and a
            # hidden state a slot)
            pool = LLM(self.path, dtype="float32", kv_cache_bytes=16 * 2 ** 20,
                       speculative_config=options.get("speculative_config")
                       ).engine.model_runner.cache_pool
            budget = 16 * 2 ** 20 if blocks is None else (
                blocks * pool.bytes_per_block + slots * pool.bytes_per_slot)
            self.engines[name] = LLM(self.path, dtype="float32", kv_cache_bytes=budget,
                                     max_num_seqs=MAX_NUM_SEQS, **options).engine
        return self.engines[name]

    tokens_alone = Engines.tokens_alone  # each request run alone on the reference engine


class HybridMachine(EngineMachine):
    @invariant()
    def slots_are_owned(self):
        if not hasattr(self, "engine"):
            return
        manager = self.engine.block_manager
        held = []
        for seq in self.engine.requests.values():
            assert (seq.state_slot is not None) == bool(seq.block_table), seq.request_id
            if seq.state_slot is not None:
                held.append(seq.state_slot)
        assert len(held) == len(set(held)), f"a state slot shared by live sequences: {held}"
        assert sorted(held + manager.free_slots) == list(range(manager.num_state_slots))
        kept = list(manager.checkpoints.values())
        assert not manager.pending_saves and not any(
            seq.restore_slot is not None for seq in self.engine.requests.values())
        assert sorted(kept + manager.free_checkpoints) == list(range(
            manager.num_state_slots, manager.num_state_slots + manager.num_checkpoint_slots))
        assert all(h in manager.hash_to_block for h in manager.checkpoints)
        self.fixture.stats["checkpoints"] = max(self.fixture.stats.get("checkpoints", 0),
                                                len(kept))

    def check_idle(self):
        super().check_idle()
        manager = self.engine.block_manager
        assert manager.num_free_slots == manager.num_state_slots == MAX_NUM_SEQS
        assert manager.reset_prefix_cache()
        assert not manager.checkpoints
        assert len(manager.free_checkpoints) == manager.num_checkpoint_slots


@pytest.mark.generated
def test_engine_state_machine_on_a_hybrid_model(tmp_path_factory):
    engines = HybridEngines(tmp_path_factory.mktemp("hybrid-machine"))
    HybridMachine.fixture = engines
    # as many examples per engine as with two engines: the derandomized first ones are small
    HybridMachine.TestCase.settings = settings(max_examples=EXAMPLES // 2,
                                              stateful_step_count=STEPS, deadline=None,
                                              suppress_health_check=list(HealthCheck))
    for name in sorted(ENGINES):
        HybridMachine.engine_name = name
        HybridMachine.TestCase().runTest()
    stats = dict(engines.stats)
    stats["preemptions"] = {n: e.scheduler.num_preemptions for n, e in engines.engines.items()}
    stats["checkpoint_slots"] = {n: e.resolved.num_checkpoint_slots
                                 for n, e in engines.engines.items()}
    print(f"hybrid engine state machine: {stats}")
    assert stats["examples"] >= EXAMPLES and stats["compared"] >= EXAMPLES // 2
    assert stats["checkpoint_slots"] == {"tight-pool": 0, "chunked": MAX_NUM_SEQS,
                                         "tight-prefix": 2, "speculating": 2, "mtp": 2}
    assert engines.engines["speculating"].speculator.num_drafts > 0
    assert engines.engines["mtp"].speculator.num_drafts > 0
    assert stats["checkpoints"] > 0  # prefix caching took checkpoints
    # The generated workloads need not overflow the tight pools (under xdist they once did not):
    # four 80-token requests on their blocks must, and still come out as each one alone; on the
    # pool with checkpoints a preempted request comes back through its own checkpoint.
    for name in ("tight-pool", "tight-prefix"):
        tight = engines.engine(name)
        before = tight.scheduler.num_preemptions
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        prompts = [tuple(range(3 + i, 43 + i)) for i in range(MAX_NUM_SEQS)]
        ids = [tight.add_request({"prompt_token_ids": list(p)}, params) for p in prompts]
        done = {o.request_id: o for o in drive(tight, ids) if o.finished}
        for prompt, request_id in zip(prompts, ids):
            assert [done[request_id].outputs[0].token_ids] == engines.tokens_alone(prompt,
                                                                                 params)
        assert tight.scheduler.num_preemptions > before, name
        manager = tight.block_manager
        assert manager.num_free_slots == manager.num_state_slots and not tight.requests


def test_a_prefix_hit_verifying_proposals_puts_back_its_checkpoint(tmp_path):
    """Found by the exploring state machine: four crowded requests on the MTP engine's tight pool;
    one is preempted at a checkpointed block boundary, its prefix hit restores the checkpoint in the
    same step its proposal is verified and rejected, and the put-back must return the checkpoint's
    state (a snapshot taken before the restore returned the slot's stale state: other tokens)."""
    engines = HybridEngines(tmp_path)
    engine = engines.engine("mtp")
    body = [3] * 18 + [4] + [3] * 23
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [tuple(body[i:]) for i in range(4)]
    verified_restores = []
    execute = engine.model_runner.execute

    def watching(batch, *args, **kwargs):
        restored = {slot for _, slot in batch.state_restores}
        verified_restores.extend(seq.request_id for seq in batch.seqs
                                 if seq.spec_token_ids and seq.state_slot in restored)
        return execute(batch, *args, **kwargs)
    engine.model_runner.execute = watching
    for i, prompt in enumerate(prompts):
        engine.add_request({"prompt_token_ids": list(prompt)}, params, request_id=str(i))
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                seen[out.request_id] = list(out.outputs[0].token_ids)
    assert engine.scheduler.num_preemptions and verified_restores, "the case no longer arises"
    for i, prompt in enumerate(prompts):
        assert [seen[str(i)]] == engines.tokens_alone(prompt, params), i
