"""Subprocesses the tests start and stop: a free port, a job SIGKILLed halfway, the Ray CLI, and
SIGINT's disposition (conftest.py checks every test leaves it as the run started)."""
import os
import signal
import socket
import subprocess
import sys
import time

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sigkill_after_lines(cmd: list[str], out, lines: int, timeout: float, cwd: str) -> None:
    """Run cmd and SIGKILL it once the file `out` holds `lines` complete lines: a job killed
    halfway, for the resume tests. Fails when the job ends (or the timeout passes) before it can be
    killed."""
    sigkill_when(cmd, lambda: out.exists() and out.read_bytes().count(b"\n") >= lines, timeout, cwd)


def sigkill_when(cmd: list[str], ready, timeout: float, cwd: str) -> None:
    """Run cmd and SIGKILL it once ready() is true (e.g. an output folder holds N part files)."""
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
