"""The test tree's own rules, read from its sources: a test module imports builders from
tests/support/ and emulated devices from tests/fakes/ (the only folders pyproject puts on the
path), never another test module or conftest; the generated (hypothesis) tests take their
draws from one profile per tier (tests/support/hypothesis_draws.py), so no test derandomizes or
explores by itself, and each is marked for the slow tier's exploring rerun; the profile choice
refuses a value it does not know; the two profiles are what the tiers promise."""
import ast
import os
import tomllib

import pytest

import hypothesis_draws
from dependencies import REPO

TESTS = os.path.join(REPO, "tests")


def tree_modules() -> dict[str, ast.Module]:
    """Every test module (test_*.py) of the tree, parsed, by its path relative to tests/."""
    found = {}
    for root, _, names in os.walk(TESTS):
        for name in names:
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(root, name)
                found[os.path.relpath(path, TESTS)] = ast.parse(open(path).read(), path)
    return found


def tree_sources() -> dict[str, ast.Module]:
    """Every .py file of the tree (tests, support, fakes, conftest), parsed."""
    found = {}
    for root, _, names in os.walk(TESTS):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                found[os.path.relpath(path, TESTS)] = ast.parse(open(path).read(), path)
    return found


def imports_of_test_modules(sources: dict[str, ast.Module]) -> list[str]:
    """'file: module' for every import of a test module or conftest, at any depth."""
    found = []
    for path, tree in sorted(sources.items()):
        for node in ast.walk(tree):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path}: {n}" for n in names
                      if n.split(".")[0].startswith("test_") or n.split(".")[0] == "conftest"]
    return found


def test_no_test_module_imports_another():
    assert imports_of_test_modules(tree_sources()) == []


def test_the_import_check_sees_a_test_module_imported_at_any_depth():
    planted = ast.parse("import os\n"
                        "def test_x():\n"
                        "    from test_text_parity import PROMPTS\n"
                        "    import conftest\n")
    assert imports_of_test_modules({"test_planted.py": planted}) == [
        "test_planted.py: test_text_parity", "test_planted.py: conftest"]


def test_only_support_and_fakes_are_on_the_path():
    """What the test modules share lives in tests/support/ (builders) and tests/fakes/ (emulated
    devices); no other test folder is importable by name."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        options = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert options["pythonpath"] == ["tests/support", "tests/fakes"]
    for folder in options["pythonpath"]:
        names = os.listdir(os.path.join(REPO, folder))
        assert not [n for n in names if n.startswith("test_") or n == "conftest.py"], folder


def _uses_hypothesis(tree: ast.Module) -> bool:
    """Imports hypothesis' given or its stateful machines: draws cases."""
    return any(isinstance(n, ast.ImportFrom) and (n.module == "hypothesis.stateful" or (
        n.module == "hypothesis" and any(a.name == "given" for a in n.names)))
        for n in ast.walk(tree))


def _marked_generated(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == hypothesis_draws.MARKER
               and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
               for n in ast.walk(tree))


def _setting_keywords(tree: ast.Module) -> set[str]:
    """The keywords given to hypothesis' settings(...) calls."""
    return {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name) and n.func.id == "settings" for k in n.keywords}


def generated_rule_breaks(modules: dict[str, ast.Module]) -> list[str]:
    broken = []
    for path, tree in sorted(modules.items()):
        if not _uses_hypothesis(tree):
            continue
        if not _marked_generated(tree):
            broken.append(f"{path}: a hypothesis test not marked {hypothesis_draws.MARKER}")
        own = _setting_keywords(tree) & {"derandomize", "print_blob", "database"}
        if own:
            broken.append(f"{path}: settings({', '.join(sorted(own))}=...) (the profile's)")
    return broken


def test_generated_tests_take_their_draws_from_the_tier_profile():
    modules = tree_modules()
    assert sum(_uses_hypothesis(t) for t in modules.values()) >= 6
    assert generated_rule_breaks(modules) == []


def test_the_check_sees_a_test_that_derandomizes_itself_or_is_unmarked():
    planted = ast.parse("from hypothesis import given, settings\n"
                        "@settings(max_examples=5, derandomize=True)\n"
                        "@given(x=st.integers())\n"
                        "def test_x(x): pass\n")
    assert generated_rule_breaks({"test_planted.py": planted}) == [
        "test_planted.py: a hypothesis test not marked generated",
        "test_planted.py: settings(derandomize=...) (the profile's)"]


def test_the_tier_picks_the_profile_and_a_reproducible_seed(monkeypatch):
    from hypothesis import core, settings
    before = settings.get_current_profile_name()
    monkeypatch.setattr(core, "global_force_seed", None)
    try:
        monkeypatch.setenv(hypothesis_draws.MODE_ENV, "explore")
        monkeypatch.setenv(hypothesis_draws.SEED_ENV, "1234")
        hypothesis_draws.load_profile()
        assert not settings().derandomize and settings().print_blob
        assert hypothesis_draws.run_seed() == 1234 == core.global_force_seed
        assert "VLINFER_HYPOTHESIS_SEED=1234" in hypothesis_draws.reproduce(1234, "t.py::x")
        monkeypatch.delenv(hypothesis_draws.SEED_ENV)
        monkeypatch.setattr(core, "global_force_seed", None)
        fresh = hypothesis_draws.run_seed()  # drawn, then kept for the whole run
        assert isinstance(fresh, int) and hypothesis_draws.run_seed() == fresh
        monkeypatch.delenv(hypothesis_draws.MODE_ENV)
        hypothesis_draws.load_profile()
        assert settings().derandomize and hypothesis_draws.run_seed() is None
        monkeypatch.setenv(hypothesis_draws.MODE_ENV, "explor")
        with pytest.raises(ValueError, match="VLINFER_HYPOTHESIS='explor'"):
            hypothesis_draws.load_profile()
    finally:
        settings.load_profile(before)
