"""`python -m vlinfer ...` end to end, as subprocesses: help for every subcommand, generate with the
real SmolLM2 and with images on the embedded Qwen3-VL, a missing model (exit code 2 and what was
tried), chat driven through stdin (streamed answer, /image refused by a text model) and bench's
passthrough. The two SmolLM2 processes start together at the beginning of the module, so their model
loads overlap with the rest."""
import inspect
import os
import subprocess
import sys
import threading

import pytest

from vlinfer.cli import main
from vlinfer.cli.options import parse_size as _size

# A bound for a hung subprocess, not a speed check: a model load plus a first kernel build on a busy
# 2-core machine has taken over 120 s.
SUBPROCESS_TIMEOUT_S = 400
from dependencies import REPO
IMAGE = os.path.join(REPO, "examples", "images", "cat_face.png")
SMALL = ["--max-model-len", "512", "--kv-cache-size", "32M"]
TINY = ["--model", "qwen3-vl-tiny", "--max-pixels", str(64 * 64), "--max-tokens", "4", *SMALL]


def vlinfer(*args) -> list[str]:
    return [sys.executable, "-m", "vlinfer", *args]


class Streamed:
    """A subprocess whose stdout is read as it arrives: each os.read is kept as one chunk with its
    time."""

    def __init__(self, cmd, stdin_text: str, stderr_path: str):
        self.stderr_file = open(stderr_path, "w+")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr_file)
        self.proc.stdin.write(stdin_text.encode())
        self.proc.stdin.close()  # input() reads the lines as it needs them
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while chunk := os.read(self.proc.stdout.fileno(), 4096):
            self.chunks.append(chunk)

    def wait(self, timeout: float):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.reader.join(timeout=10)
        self.stderr_file.seek(0)
        return self.proc.returncode, b"".join(self.chunks).decode(), self.stderr_file.read()


@pytest.fixture(scope="module", autouse=True)
def smollm2_runs(request, tmp_path_factory):
    """Start `generate` and `chat` on SmolLM2 at once, before the first test of the module (when a
    test that needs them is selected), so their loads run while the other tests do; the last tests
    collect them."""
    if not any(
            getattr(item, "module", None) is request.module and
            "smollm2_runs" in inspect.signature(item.function).parameters
            for item in request.session.items):
        yield None
        return
    tmp = tmp_path_factory.mktemp("cli")
    out, err = open(tmp / "gen.out", "w+"), open(tmp / "gen.err", "w+")
    generate = subprocess.Popen(
        vlinfer("generate", "What is the capital of France? Answer in one sentence.",
                "--max-tokens", "16", *SMALL), cwd=REPO, stdout=out, stderr=err)
    # Greedy (the chat's default temperature is a sampling one), so the answer can be checked word
    # for word.
    chat = Streamed(vlinfer("chat", "--max-tokens", "24", "--temperature", "0", *SMALL),
                    f"/image {IMAGE}\nhello\n/exit\n",
                    str(tmp / "chat.err"))
    yield {"generate": (generate, out, err), "chat": chat}
    for proc in (generate, chat.proc):
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["caption"], ["embed"], ["bench"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    assert text.startswith(f"usage: vlinfer {command[0] if command else ''}".rstrip())
    expected = {
        "generate": ["--image PATH", "smollm2 without --image, qwen3-vl with --image"],
        "chat": ["/image PATH", "--model qwen3-vl"], "caption": [
            "--out", "--resume", "--batch-size", "--max-pixels", "--prompt", "--max-tokens"
        ], "embed": [
            "--out", "--resume", "--text-column", "--instruction", "--dimensions", "--batch-size",
            "--ray [ADDRESS]", "--replicas", "default: qwen3-vl-embedding"
        ], "bench": ["bench/throughput.py", "--num-requests", "--skip-transformers"]
    }
    for snippet in expected.get(command[0] if command else "",
                                ["generate", "chat", "caption", "embed", "bench"]):
        assert snippet in text, snippet


def test_size_option():
    assert _size("512M") == 512 * 2**20 and _size("2G") == 2 * 2**30 and _size(
        "1.5GiB") == 3 * 2**29
    assert _size("4096") == 4096


def test_missing_model_exit_code_and_tried_list():
    res = subprocess.run(vlinfer("generate", "hi", "--model", "no-such-model"), cwd=REPO,
                         capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode == 2
    assert "error: model 'no-such-model' not found. Tried: local path" in res.stderr
    assert "known aliases" in res.stderr and "smollm2" in res.stderr \
        and "Traceback" not in res.stderr


def offline_answer(model: str, content, max_tokens: int, **mm_kwargs) -> str:
    """What the same request answers through the Python API, greedy: what the CLI must print."""
    from vlinfer import LLM, SamplingParams
    llm = LLM(model, max_model_len=512, kv_cache_bytes=32 << 20)
    out = llm.chat([{"role": "user", "content": content}],
                   SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False,
                   mm_processor_kwargs=mm_kwargs or None)[0]
    return out.outputs[0].text


@pytest.mark.slow  # a CLI subprocess that loads a model
def test_generate_with_images_on_the_embedded_vl_model():
    res = subprocess.run(
        vlinfer("generate", "Describe these.", "--image", IMAGE, "--image", IMAGE, *TINY,
                "--temperature", "0"), cwd=REPO, capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    # Meaningless words, but the model's answer to both images and the text.
    content = [{"type": "image", "image": IMAGE}, {"type": "image", "image": IMAGE},
               {"type": "text", "text": "Describe these."}]
    assert res.stdout == offline_answer("qwen3-vl-tiny", content, 4, max_pixels=64 * 64) + "\n"
    assert "MEANINGLESS" in res.stderr  # the loader says so, loudly


@pytest.mark.slow  # a CLI subprocess that loads a model
def test_bench_passes_arguments_through():
    res = subprocess.run(
        vlinfer("bench", "--model", "qwen3-vl-tiny", "--dtype", "float32", "--num-requests", "2",
                "--min-input", "4", "--max-input", "8", "--min-output", "2", "--max-output", "3",
                "--skip-transformers"), cwd=REPO, capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    assert "workload: 2 requests" in res.stdout and "| vlinfer |" in res.stdout


@pytest.mark.slow  # a CLI subprocess that loads a model
def test_generate_text_model(smollm2_runs):
    proc, out, err = smollm2_runs["generate"]
    assert proc.wait(timeout=SUBPROCESS_TIMEOUT_S) == 0, (err.seek(0), err.read())[1]
    out.seek(0)
    assert "Paris" in out.read()


@pytest.mark.slow  # a CLI subprocess that loads a model
def test_chat_through_stdin(smollm2_runs):
    chat = smollm2_runs["chat"]
    code, stdout, stderr = chat.wait(timeout=SUBPROCESS_TIMEOUT_S)
    assert code == 0, stderr
    assert "chatting with smollm2 (text-only)" in stderr
    # /image on a text model: refused with a clear message, the chat goes on.
    assert "model 'smollm2' is a text-only model and does not accept images" in stderr \
        and "--model qwen3-vl" in stderr
    # prompts: before /image, before hello, before /exit
    answer = stdout.split("> ", 2)[2].rsplit("> ", 1)[0]
    # the rejected /image left no trace
    assert answer == offline_answer("smollm2", "hello", 24) + "\n", stdout
    # Streamed: the answer came out in several pieces, not at once.
    pieces = [c for c in chat.chunks if c.strip() and c.strip() != b">"]
    assert len(pieces) >= 2, chat.chunks


@pytest.mark.slow  # a CLI subprocess that loads a model
def test_default_context_length_follows_the_model(tiny_vl_with_context, tmp_path):
    """No --max-model-len: a model with 2048 positions runs at 2048 (a fixed default of 4096 used to
    exceed it); one with 262144 (as Qwen3-VL declares) is capped at 8192 and then fitted to a small
    KV cache, with a warning."""
    short, long = tiny_vl_with_context(2048), tiny_vl_with_context(262144)
    common = ["--max-tokens", "4", "--max-pixels", str(64 * 64)]
    commands = {
        "generate 2048": vlinfer("-v", "generate", "Hello there.", "--model", short, *common),
        "generate 262144": vlinfer("generate", "Describe it.", "--image", IMAGE, "--model", long,
                                   "--kv-cache-size", "3M", *common),
        "caption 262144": vlinfer("caption", IMAGE, "--out", str(tmp_path / "captions.jsonl"),
                                  "--model", long, "--kv-cache-size", "3M", "--no-progress",
                                  *common),
    }
    procs = {
        name: subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        for name, cmd in commands.items()
    }  # at once: their model loads overlap
    results = {name: proc.communicate(timeout=SUBPROCESS_TIMEOUT_S) for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, results[name][1][-2000:])
    out, err = results["generate 2048"]
    assert out == offline_answer(short, "Hello there.", 4) + "\n"
    # the CLI's flag
    assert "--max-model-len=2048 (the model's max_position_embeddings=2048)" in err
    for name in ("generate 262144", "caption 262144"):
        err = results[name][1]
        # The CLI's flags, not the engine's keyword names (tests/cli/test_app_errors.py)
        assert "--max-model-len=3072: the KV cache" in err \
            and "the default --max-model-len cap=8192" in err, (name, err[-2000:])
    assert results["generate 262144"][0].strip()
    assert '"caption"' in (tmp_path / "captions.jsonl").read_text()
