"""How the generated (hypothesis) tests draw their cases: one settings profile per tier, chosen
here for every test, so no test names derandomize itself.

The default tier ('derandomized'): the same cases every run, so a red run is the code's, not the
draw's. `make test-full` reruns the tests marked `generated` in its slow pass with
VLINFER_HYPOTHESIS=explore ('explore'): the same properties and case counts on fresh draws, from a
new seed each run (VLINFER_HYPOTHESIS_SEED, else drawn), which the run's header and every failing
test's report print with the command that repeats the run's draws."""
import os
import random

MODE_ENV, SEED_ENV = "VLINFER_HYPOTHESIS", "VLINFER_HYPOTHESIS_SEED"
MARKER = "generated"  # the tests the slow pass reruns exploring (pyproject's markers)


def exploring() -> bool:
    mode = os.environ.get(MODE_ENV, "")
    if mode not in ("", "explore"):
        raise ValueError(f"{MODE_ENV}={mode!r}: the only value is 'explore' (unset: derandomized)")
    return mode == "explore"


def load_profile() -> None:
    """Loads this run's profile: before the test modules are imported, as a settings object takes
    the profile loaded when it is made."""
    from hypothesis import settings
    settings.register_profile("derandomized", derandomize=True, print_blob=True)
    settings.register_profile("explore", derandomize=False, print_blob=True)
    settings.load_profile("explore" if exploring() else "derandomized")


def run_seed() -> int | None:
    """Exploring, this run's seed (a --hypothesis-seed given to pytest wins; else SEED_ENV, else a
    fresh one), fixed for every test; None when derandomized."""
    from hypothesis import core
    if not exploring():
        return None
    if core.global_force_seed is None:
        fresh = random.SystemRandom().getrandbits(32)
        core.global_force_seed = int(os.environ.get(SEED_ENV) or fresh)
    return core.global_force_seed


def reproduce(seed: int, nodeid: str) -> str:
    """The command that reruns one test on this run's draws."""
    return f"{MODE_ENV}=explore {SEED_ENV}={seed} python -m pytest -p no:xdist '{nodeid}'"
