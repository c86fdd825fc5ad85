"""How the generated (hypothesis) tests draw their cases: the default tier derandomized, the same
cases every run (a red run is the code's, not the draw's); the slow tier exploring, a fresh seed
each run, a failure printing the blob that reproduces it (@reproduce_failure)."""


def draws(explore: bool) -> dict:
    """hypothesis.settings keywords for a default-tier (explore=False) or slow-tier run."""
    return dict(derandomize=not explore, print_blob=True)
