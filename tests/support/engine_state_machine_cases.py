"""Builders and constants of tests/engine/test_engine_state_machine.py that other test modules use
too (EngineMachine, Engines): imported from here by every one of them, that module included."""
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from text_checkpoints import build_checkpoint, tiny_text_config
from engine_machines import EngineRules, check_block_pool, completions_done
from vlinfer import LLM, SamplingParams

VOCAB = 500
# longer than a block of 16
PREFIX = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
# name -> engine options: a pool of 6 blocks of 16 tokens (preemption), a budget of 8 tokens a step
# (chunked prefill), speculative decoding by n-grams and by a draft model.
ENGINES = {
    "tight-pool": dict(kv_cache_bytes=6 * 8192, max_model_len=96),
    "chunked": dict(max_num_batched_tokens=8, max_model_len=128),
    "ngram": dict(
        speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "adaptive": False
        }),
    "draft": dict(
        kv_cache_bytes=12 * 8192 * 2, max_model_len=128,
        speculative_config={"model": None, "num_speculative_tokens": 2, "adaptive": False}),
}


class Engines:
    """One tiny random Qwen3 (and a draft of other weights), the engines of ENGINES built once, and
    the reference outputs of each request alone."""

    def __init__(self, folder):
        self.path, self.draft_path = str(folder / "target"), str(folder / "draft")
        build_checkpoint(self.path, tiny_text_config("qwen3", True))
        build_checkpoint(self.draft_path, tiny_text_config("qwen3", True), seed=5)
        self.engines = {}
        self.reference = LLM(self.path, dtype="float32", kv_cache_bytes=16 * 2 ** 20)
        self.alone = {}
        # What the runs did, for the assertions that they did something and for the report.
        self.stats = dict(examples=0, requests=0, aborted=0, refused=0, steps=0, compared=0)

    def engine(self, name):
        if name not in self.engines:
            options = dict(ENGINES[name])
            if name == "draft":
                options["speculative_config"] = dict(options["speculative_config"],
                                                     model=self.draft_path)
            self.engines[name] = LLM(self.path, dtype="float32",
                                     **{"kv_cache_bytes": 16 * 2**20, **options}).engine
        return self.engines[name]

    def tokens_alone(self, prompt: tuple, params: SamplingParams) -> list[list[int]]:
        key = (prompt, repr(params))
        if key not in self.alone:
            out = self.reference.generate([{"prompt_token_ids": list(prompt)}], params,
                                          use_tqdm=False)[0]
            self.alone[key] = [c.token_ids for c in sorted(out.outputs, key=lambda c: c.index)]
        return self.alone[key]


# Bodies from the whole vocabulary, or from a few tokens (repeats: n-gram proposals find matches).
prompts = st.builds(lambda shared, body: tuple((PREFIX if shared else []) + body), st.booleans(),
                    st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40) |
                    st.lists(st.integers(3, 8), min_size=2, max_size=40))
sampling = st.builds(
    lambda greedy, n, max_tokens, seed: SamplingParams(
        temperature=0 if greedy else 0.9, n=1
        if greedy else n, max_tokens=max_tokens, ignore_eos=True, seed=None if greedy else seed),
    st.booleans(), st.integers(1, 3), st.integers(1, 12), st.integers(0, 2**16))


class EngineMachine(EngineRules):
    fixture = None  # the module's Engines, set by the test

    engine_name = None  # the engine of ENGINES this run uses, set by run_machine

    @initialize()
    def start(self):
        self.engine = self.fixture.engine(self.engine_name)
        # Every example starts from the same state, so hypothesis can replay and shrink it: an empty
        # prefix cache, request ids of its own.
        assert self.engine.block_manager.reset_prefix_cache()
        self.ids = iter(range(10 ** 9))
        self.stats = self.fixture.stats
        self.stats["examples"] += 1
        assert not self.engine.has_unfinished_requests()
        self.live = {}  # request id -> (prompt, params, {index: tokens so far})
        self.done = []

    @rule(prompt=prompts, params=sampling)
    def add(self, prompt, params):
        rid = self.engine.add_request({"prompt_token_ids": list(prompt)}, params,
                                      request_id=f"r{next(self.ids)}")
        self.live[rid] = (prompt, params, {})
        self.stats["requests"] += 1

    @rule(body=st.lists(st.integers(3, VOCAB - 1), min_size=40, max_size=50),
          count=st.integers(2, 4))
    def crowd(self, body, count):
        """Several long greedy requests at once: more KV than the tight pools hold (preemption),
        prefixes shared."""
        for i in range(count):
            self.add(tuple(body[i:]), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))

    @precondition(lambda self: self.live)  # refused beside live requests, which must not notice
    @rule(too_long=st.booleans())
    def refused(self, too_long):
        """A prompt past max_model_len, or token ids outside the vocabulary: an error naming it,
        nothing changed."""
        held, live = self._held(), len(self.engine.requests)
        with pytest.raises(ValueError, match="max_model_len" if too_long else "vocabulary"):
            self.engine.add_request(
                {"prompt_token_ids": [5] * 600 if too_long else [VOCAB + 100] * 3},
                SamplingParams(max_tokens=2), request_id="refused")
        assert self._held() == held and len(self.engine.requests) == live
        self.stats["refused"] += 1

    def record(self, out):
        prompt, params, seen = self.live[out.request_id]
        if completions_done(seen, out, params.n):
            self.done.append(self.live.pop(out.request_id))

    @invariant()
    def blocks_are_counted(self):
        if not hasattr(self, "engine"):
            return
        for manager, seqs in self._pools():
            check_block_pool(manager, seqs)
        cache = self.engine.model_runner.encoder_cache
        live = {seq.seq_id for seq in self.engine.requests.values()}
        assert all(holders <= live for holders in cache.holders.values())

    def _pools(self):
        engine = self.engine
        yield engine.block_manager, list(engine.requests.values())
        draft = engine.speculator.draft
        if draft is not None:
            assert set(draft.shadows) <= {seq.seq_id for seq in engine.requests.values()}
            yield draft.block_manager, list(draft.shadows.values())

    @invariant()
    def finished_requests_equal_their_runs_alone(self):
        """Greedy ones everywhere; seeded sampled ones where nothing is speculated (with proposals,
        how many uniforms a step draws depends on its proposals, which the batch's token budget and
        free blocks cut)."""
        while getattr(self, "done", None):
            prompt, params, seen = self.done.pop()
            if params.temperature == 0 or self.engine.config.speculative_config is None:
                assert [seen[i]
                        for i in range(params.n)] == self.fixture.tokens_alone(prompt, params)
                self.stats["compared"] += 1

    def check_idle(self):
        self.blocks_are_counted()
        assert all(b.ref_count == 0 for b in self.engine.block_manager.blocks)
        assert len(self.engine.model_runner.encoder_cache) == 0
        draft = self.engine.speculator.draft
        assert draft is None or (not draft.shadows and draft.block_manager.num_free_blocks
                                 == draft.block_manager.num_blocks)
