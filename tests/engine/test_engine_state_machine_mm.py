"""The engine core as a state machine on the paths test_engine_state_machine.py's text engines do
not reach: a tiny
random Qwen3-VL run as a pooling engine that generates too, with LoRA on (one slot, one adapter kept
on the host, so
adapters are swapped in and out of the slot and read again), a KV pool that forces preemption and a
token budget that
chunks prefills. Requests with and without an image (three pictures: the encoder cache is shared
between requests,
and keyed by the vision adapter), under a language-only adapter, a vision adapter or none,
generation and embedding
requests, are added, aborted stepped and drained in a random order, beside requests that must be
refused. After every rule:
- each block's reference count equals the number of live sequences' tables that hold it, the free
  list is exactly
  the blocks nobody holds, every prefix-cache hash names a block that carries it;
- the encoder cache's holders are exactly the live sequences' images (by their key) and it keeps no
  output
  nobody holds;
- the step's adapters fit the slots (at most max_loras distinct adapters run), the host keeps at
  most max_cpu_loras
  adapters besides the installed one;
- every finished request equals what it gives alone on a roomy engine with two slots: the same
  greedy tokens, the
  same embedding within 1e-5 (a sampled one: its n completions, each of max_tokens tokens);
and at the end, once everything finished or was aborted, no block is held and no encoder entry is
left.

The suite runs EXAMPLES examples of up to STEPS rules: derandomized in the default tier, on fresh
draws in the slow tier (tests/support/hypothesis_draws.py)."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from engine_machines import EngineRules, check_block_pool, completions_done
from images import picture
from vlinfer import LLM, LoRARequest, PoolingParams, SamplingParams
from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
from lora_cases import make_adapter
from lora_vision_cases import TEXT, VISION

EXAMPLES, STEPS = 40, 30
TOL = 1e-5
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# Three pictures (an image is 64 tokens at the checkpoint's minimum size): requests share them, so
# the encoder cache holds one entry for several requests.
PICTURES = [picture(64, 64, 1), picture(96, 64, 2), picture(64, 96, 3)]
WORDS = [
    "red", "house", "two", "blue", "stars", "a", "cat", "runs", "over", "the", "hill", "and",
    "sings"
]
# a common prefix: prefix-cache hits
SHARED = "Describe this in detail, one thing after another, please: "
# name -> (rank, alpha, rslora, targets, seed): a language-only adapter and one on the vision tower
# as well.
ADAPTERS = {"text": (8, 16, False, TEXT, 1), "eyes": (4, 8, True, f"{VISION}|{TEXT}", 2)}
# One slot and one adapter on the host: two adapters take turns in the slot and are read again from
# disk; a pool of 14 blocks of 16 tokens (two image requests do not fit at once: preemption); 32
# tokens a step (chunked prefill).
OPTIONS = dict(dtype="float32", runner="pooling", enable_lora=True, max_loras=1, max_cpu_loras=1,
               max_lora_rank=8, max_model_len=160, max_num_batched_tokens=32)
POOL_BLOCKS = 14


class Engines:
    """The checkpoint and its adapters, the engine under test and a roomy reference engine, and the
    reference outputs of each request alone."""

    def __init__(self, folder):
        from transformers import Qwen3VLForConditionalGeneration
        self.path = build_tiny_qwen3_vl(str(folder / "vl"), seed=0, tie_word_embeddings=False)
        self.adapters = {None: None}
        for i, (name, spec) in enumerate(ADAPTERS.items()):
            base = Qwen3VLForConditionalGeneration.from_pretrained(self.path, dtype=torch.float32)
            self.adapters[name] = LoRARequest(name, i + 1,
                                              make_adapter(base, str(folder / name), *spec))
        base = Qwen3VLForConditionalGeneration.from_pretrained(self.path, dtype=torch.float32)
        self.too_wide = LoRARequest(
            "too-wide", 9, make_adapter(base, str(folder / "too-wide"), 16, 16, False, TEXT, 3))
        self.reference = LLM(
            self.path, **{
                **OPTIONS, "max_loras": 2, "max_cpu_loras": 3, "max_num_batched_tokens": 512,
                "kv_cache_bytes": 64 * 2**20
            })
        runner = self.reference.engine.model_runner
        pool_bytes = ((POOL_BLOCKS + runner.cache_pool.num_dummy_blocks)
                      * self.reference.engine.resolved.bytes_per_block)
        self.engine = LLM(self.path, **OPTIONS, kv_cache_bytes=pool_bytes).engine
        assert self.engine.resolved.num_blocks == POOL_BLOCKS
        runner, install = self.engine.model_runner, self.engine.model_runner.install_lora

        # adapters put into the slot (a swap each time after the first)
        def counted_install(*args, **kwargs):
            self.stats["installs"] += 1
            return install(*args, **kwargs)
        runner.install_lora = counted_install
        self.alone = {}
        self.stats = dict(examples=0, requests=0, embeds=0, images=0, adapted=0, aborted=0,
                          refused=0, steps=0, compared=0, installs=0)

    def alone_output(self, prompt, params, adapter):
        key = (repr(prompt), repr(params), adapter)
        if key not in self.alone:
            lora = self.adapters[adapter]
            if isinstance(params, PoolingParams):
                out, = self.reference.embed([prompt], lora_request=lora, use_tqdm=False)
                self.alone[key] = torch.tensor(out.outputs.embedding)
            else:
                out, = self.reference.generate([prompt], params, lora_request=lora, use_tqdm=False)
                self.alone[key] = [c.token_ids for c in sorted(out.outputs, key=lambda c: c.index)]
        return self.alone[key]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return Engines(tmp_path_factory.mktemp("state-machine-mm"))


def make_prompt(shared: bool, words: list[str], image: int | None):
    text = (SHARED if shared else "") + (IMAGE if image is not None else "") + " ".join(words)
    text = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return {"prompt": text, "multi_modal_data": {"image": [PICTURES[image]]}
            } if image is not None else text


prompts = st.builds(make_prompt, st.booleans(),
                    st.lists(st.sampled_from(WORDS), min_size=1, max_size=12),
                    st.none() | st.integers(0,
                                            len(PICTURES) - 1))
sampling = st.builds(
    lambda greedy, n, max_tokens, seed: SamplingParams(
        temperature=0 if greedy else 0.9, n=1
        if greedy else n, max_tokens=max_tokens, ignore_eos=True, seed=None if greedy else seed),
    st.booleans(), st.integers(1, 2), st.integers(1, 10), st.integers(0, 2**16))
adapters = st.sampled_from([None, *ADAPTERS])


class MultimodalMachine(EngineRules):
    fixture = None  # the module's Engines, set by the test

    @initialize()
    def start(self):
        self.engine = self.fixture.engine
        # every example starts from the same state
        assert self.engine.block_manager.reset_prefix_cache()
        self.ids = iter(range(10 ** 9))
        self.stats = self.fixture.stats
        self.stats["examples"] += 1
        assert not self.engine.has_unfinished_requests()
        self.live = {}  # request id -> (prompt, params, adapter, {index: tokens so far})
        self.done = []  # (prompt, params, adapter, tokens by index or the embedding)

    def _add(self, prompt, params, adapter):
        rid = self.engine.add_request(prompt, params, request_id=f"r{next(self.ids)}",
                                      lora_request=self.fixture.adapters[adapter])
        self.live[rid] = (prompt, params, adapter, {})
        self.stats["requests"] += 1
        self.stats["images"] += not isinstance(prompt, str)
        self.stats["adapted"] += adapter is not None

    @rule(prompt=prompts, params=sampling, adapter=adapters)
    def generate(self, prompt, params, adapter):
        self._add(prompt, params, adapter)

    @rule(prompt=prompts, adapter=adapters)
    def embed(self, prompt, adapter):
        self._add(prompt, PoolingParams(task="embed"), adapter)
        self.stats["embeds"] += 1

    @rule(images=st.lists(st.integers(0,
                                      len(PICTURES) - 1), min_size=2, max_size=3), adapter=adapters)
    def crowd(self, images, adapter):
        """Image requests at once: more KV than the pool holds (preemption), the same picture in
        several."""
        for image in images:
            self._add(make_prompt(True, WORDS[:6], image),
                      SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), adapter)

    @precondition(lambda self: self.live)  # refused beside live requests, which must not notice
    @rule(kind=st.sampled_from(["rank", "images", "length"]))
    def refused(self, kind):
        """An adapter of a rank above max_lora_rank, a prompt with more image placeholders than
        images, a prompt past max_model_len: an error naming it, nothing changed."""
        held, live, entries = self._held(), len(self.engine.requests), len(
            self.engine.model_runner.encoder_cache)
        prompt, lora, match = make_prompt(False, WORDS, None), None, "max_model_len"
        if kind == "rank":
            lora, match = self.fixture.too_wide, "max_lora_rank"
        elif kind == "images":
            prompt, match = {
                "prompt": IMAGE * 2 + "two?", "multi_modal_data": {"image": [PICTURES[0]]}
            }, "image"
        else:
            prompt = " ".join(WORDS * 20)
        with pytest.raises(ValueError, match=match):
            self.engine.add_request(prompt, SamplingParams(max_tokens=2), request_id="refused",
                                    lora_request=lora)
        assert self._held() == held and len(self.engine.requests) == live
        assert len(self.engine.model_runner.encoder_cache) == entries
        self.stats["refused"] += 1

    def before_step(self):
        running = {
            s.lora_request.lora_int_id
            for s in self.engine.scheduler.running if s.lora_request
        }
        assert len(running) <= self.engine.config.max_loras

    def record(self, out):
        prompt, params, adapter, seen = self.live[out.request_id]
        if isinstance(params, PoolingParams):
            assert out.finished
            self.done.append((prompt, params, adapter, torch.tensor(out.outputs.embedding)))
            del self.live[out.request_id]
        elif completions_done(seen, out, params.n):
            self.done.append((prompt, params, adapter, [seen[i] for i in range(params.n)]))
            del self.live[out.request_id]

    @invariant()
    def blocks_entries_and_slots_are_counted(self):
        if not hasattr(self, "engine"):
            return
        seqs = list(self.engine.requests.values())
        check_block_pool(self.engine.block_manager, seqs)
        cache = self.engine.model_runner.encoder_cache
        held = {}
        for seq in seqs:
            for item in seq.mm_items:
                held.setdefault(seq.encoder_key(item), set()).add(seq.seq_id)
        assert cache.holders == held
        assert set(cache.outputs) <= set(held)
        lora = self.engine.model_runner.lora
        installed = {i for i in lora.slots if i is not None}
        assert len(set(lora.host) - installed) <= lora.max_cpu_loras

    @invariant()
    def finished_requests_equal_their_runs_alone(self):
        """Embeddings and greedy tokens equal their runs alone. A sampled request gets its n
        completions of max_tokens tokens, not the same tokens: this random-weight model's
        distribution over 152k tokens is near uniform, so neighbouring ids lie within float32
        rounding of each other in the cumulative sum a seeded draw reads, and the last bits a
        chunked or cached prefill changes pick the neighbour (test_sampling.py and the text
        machine's 500-token vocabulary check seeded draws)."""
        while getattr(self, "done", None):
            prompt, params, adapter, got = self.done.pop()
            if isinstance(params, SamplingParams) and params.temperature > 0:
                assert len(got) == params.n and all(
                    len(tokens) == params.max_tokens for tokens in got)
                continue
            alone = self.fixture.alone_output(prompt, params, adapter)
            if isinstance(params, PoolingParams):
                assert torch.allclose(got, alone, atol=TOL, rtol=0), (got - alone).abs().max()
            else:
                assert got == alone
            self.stats["compared"] += 1

    def check_idle(self):
        self.blocks_entries_and_slots_are_counted()
        assert all(b.ref_count == 0 for b in self.engine.block_manager.blocks)
        assert len(self.engine.model_runner.encoder_cache
                   ) == 0 and not self.engine.model_runner.encoder_cache.holders


def run_machine(engines, examples: int, steps: int):
    """Run the machine; then check it ran what it should have (examples, embeddings, images and
    adapters, finished requests compared, preemptions, adapters swapped in the slot) and print what
    it did."""
    MultimodalMachine.fixture = engines
    MultimodalMachine.TestCase.settings = settings(max_examples=examples, stateful_step_count=steps,
                                                   deadline=None,
                                                   suppress_health_check=list(HealthCheck))
    MultimodalMachine.TestCase().runTest()
    stats = dict(engines.stats, preemptions=engines.engine.scheduler.num_preemptions,
                 lora_steps=engines.engine.model_runner.lora.steps)
    print(f"multimodal engine state machine: {stats}")
    assert stats["examples"] >= examples and stats["compared"] >= examples
    assert min(stats["embeds"], stats["images"], stats["adapted"], stats["refused"],
               stats["preemptions"]) > 0
    assert stats["installs"] > 2  # the two adapters took turns in the one slot


@pytest.mark.generated
def test_multimodal_engine_state_machine(engines):
    run_machine(engines, EXAMPLES, STEPS)
