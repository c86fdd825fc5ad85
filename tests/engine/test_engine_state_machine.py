"""The engine core as a state machine (hypothesis' RuleBasedStateMachine): requests of random
prompts (some sharing
a prefix, so the prefix cache hits), sampling options, n and tight max_tokens are added, aborted and
stepped in a
random order, on engines whose KV pool forces preemption, whose token budget chunks prefills, with
and without
speculative decoding, alongside requests that must be refused; now and then every live request is
run to its end
(drain). After every rule:
- each block's reference count equals the number of live sequences' tables that hold it (the draft
  model's pool
  likewise), and the free list is exactly the blocks nobody holds;
- every prefix-cache hash names a block that carries that hash;
- the encoder cache holds entries only for live sequences;
- every finished request's tokens equal what the same request gives alone on a roomy engine without
  speculation
  (greedy, or sampled with a seed);
and at the end, once everything finished or was aborted, no block is held and no entry is left.

The suite runs EXAMPLES examples of up to STEPS rules, an equal share on each engine: derandomized
in the default tier, on fresh draws in the slow tier (tests/support/hypothesis_draws.py)."""
import pytest
from hypothesis import HealthCheck, settings
from engine_state_machine_cases import ENGINES, EngineMachine, Engines


EXAMPLES, STEPS = 40, 40


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return Engines(tmp_path_factory.mktemp("state-machine"))


def run_machine(engines, examples: int, steps: int):
    """Run the machine; then check it ran what it should have (examples, finished requests compared,
    preemptions and proposals on the engines made for them) and print what it did."""
    EngineMachine.fixture = engines
    EngineMachine.TestCase.settings = settings(max_examples=examples // len(ENGINES),
                                               stateful_step_count=steps, deadline=None,
                                               suppress_health_check=list(HealthCheck))
    for name in sorted(ENGINES):  # each engine its share of the examples
        EngineMachine.engine_name = name
        EngineMachine.TestCase().runTest()
    stats = dict(engines.stats)
    stats["preemptions"] = {n: e.scheduler.num_preemptions for n, e in engines.engines.items()}
    stats["proposed"] = {n: e.speculator.num_draft_tokens for n, e in engines.engines.items()}
    print(f"engine state machine: {stats}")
    assert stats["examples"] >= examples and stats["requests"] >= examples and stats[
        "compared"] >= examples // 2
    assert stats["preemptions"]["tight-pool"] > 0 and stats["proposed"]["ngram"] > 0 and stats[
        "proposed"]["draft"] > 0


@pytest.mark.generated
def test_engine_state_machine(engines):
    run_machine(engines, EXAMPLES, STEPS)
