"""Builders and constants of tests/apps/test_demo.py that other test modules use too (NOTICE_TITLE,
_answer, _as_input, _chat, _client, _start, _stop, _texts, _wait_serving, _watch): imported from
here by every one of them, that module included."""
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dependencies import REPO
import pytest
from gradio_client import Client, handle_file

ROOT = Path(REPO)
DEMO = ROOT / "apps" / "demo.py"
STARTUP_TIMEOUT = 120  # model build / load plus gradio import; ~20 s on a busy 2-core machine
NOTICE_TITLE = "Not answered"  # apps/demo.py marks its rejection notices with this title


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it may have children), SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def _start(log_path: Path, *args: str, script: Path = DEMO) -> tuple[subprocess.Popen, int]:
    """A demo server process (script: apps/demo.py or a wrapper of it) with these arguments, on a
    free port; (process, port)."""
    port = _free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        # A new session: _stop kills the whole process group, not just the Python process.
        proc = subprocess.Popen(
            [sys.executable, str(script), *args, "--port",
             str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
    return proc, port


def _wait_serving(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the demo exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(
                f"the demo did not serve within {STARTUP_TIMEOUT}s:\n{log_path.read_text()[-3000:]}"
            )
        time.sleep(0.5)


def _client(url: str) -> Client:
    # timeout: gradio_client's plain requests (predict polls, cancel) default to httpx's 5 s, too
    # short when the machine is busy (CI, a benchmark next door); the streams themselves have no
    # timeout.
    return Client(url, verbose=False, download_files=False, analytics_enabled=False,
                  httpx_kwargs={"timeout": 60})


def _texts(message: dict) -> str:
    content = message["content"]
    parts = content if isinstance(content, list) else [content]
    return "".join(p if isinstance(p, str) else p.get("text", "") for p in parts if p)


def _answer(history: list[dict]) -> str:
    """The last assistant message's text ('' when there is none yet)."""
    for message in reversed(history or []):
        if message["role"] == "assistant":
            return _texts(message)
    return ""


def _as_input(history: list[dict]) -> list[dict]:
    """A returned chat history, sent back as a browser does: file parts keep the server's FileData
    (its path in the server's upload cache), so the images of earlier turns are not uploaded again.
    """
    for message in history:
        for part in message["content"]:
            assert part.get("type") != "file" or isinstance(part["file"], dict), part
    return history


def _chat(client: Client, text: str, files=(), history=None, max_tokens: int = 24):
    message = {"text": text, "files": [handle_file(f) for f in files]}
    return client.submit(message, history or [], 0.7, 0.9, max_tokens, api_name="/chat")


def _watch(job, poll: float = 0.05) -> list[str]:
    """The distinct answer texts the job streamed, in the order they arrived."""
    seen, read = [], 0
    while True:
        done = job.done()
        outputs = job.outputs()
        for out in outputs[read:]:
            text = _answer(out[0])
            if not seen or text != seen[-1]:
                seen.append(text)
        read = len(outputs)
        if done:
            return seen
        time.sleep(poll)
