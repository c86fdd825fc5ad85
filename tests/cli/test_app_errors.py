"""Errors name the setting in the surface the user used: keyword arguments in Python, flags in the
CLI, the server and the demo (vlinfer/cli/options.py). A mistyped --device is one line and exit code
2 in every subcommand and the demo, never a traceback."""
import logging
import os
import subprocess
import sys

import pytest

from vlinfer import LLM
from vlinfer.cli.options import FLAGS, flags_in_logs, name_flags

from dependencies import REPO
IMAGE = os.path.join(REPO, "examples", "images", "cat_face.png")
DEVICE_ERROR = ("error: --device='cdua' is not a device; use 'auto', 'cpu', 'cuda', 'cuda:N' "
                "or 'npu'")
KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 2 * 4  # the tiny Qwen3-VL's float32 KV


def test_name_flags_rewrites_keyword_names_only():
    message = (
        "KV cache budget of 1 bytes holds 0 blocks, fewer than one sequence of max_model_len=8192 "
        "needs; "
        "raise kv_cache_bytes / memory_utilization; device='cdua' is not a device; "
        "SamplingParams.top_p "
        "must be in (0, 1]; the device's default; max_model_len_cap=8192")
    assert name_flags(message) == (
        "KV cache budget of 1 bytes holds 0 blocks, fewer than one sequence of "
        "--max-model-len=8192 needs; "
        "raise --kv-cache-size / --memory-utilization; --device='cdua' is not a device; --top-p "
        "must be in (0, 1]; the device's default; the default --max-model-len cap=8192")
    assert name_flags("max_num_seqs must be a positive int",
                      {**FLAGS, "max_num_seqs": "--concurrency"}) == \
        "--concurrency must be a positive int"
    assert name_flags("max_model_len=5", {}) == "max_model_len=5"


def test_flags_in_logs_is_undone_after_the_app(caplog):
    logger = logging.getLogger("vlinfer")
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        with flags_in_logs():
            logger.warning("raise %s", "kv_cache_bytes")
        logger.warning("raise kv_cache_bytes")
    assert [r.getMessage()
            for r in caplog.records] == ["raise --kv-cache-size", "raise kv_cache_bytes"]
    assert not logger.filters


def test_python_errors_name_keyword_arguments(tiny_vl_with_context):
    with pytest.raises(ValueError, match=r"^device='cdua' is not a device; use 'auto', 'cpu'"):
        # the device is checked before the model is resolved
        LLM("no-such-model-is-looked-up", device="cdua")
    with pytest.raises(ValueError) as info:
        LLM(tiny_vl_with_context(262144), dtype="float32", device="cpu", max_model_len=8192,
            kv_cache_bytes=1024 * KV_BYTES_PER_TOKEN)
    assert "fewer than one sequence of max_model_len=8192 needs (512)" in str(info.value)
    assert "raise kv_cache_bytes / memory_utilization, lower max_model_len" in str(info.value)


def _run_all(commands: dict[str, list[str]],
             timeout: float = 240) -> dict[str, subprocess.CompletedProcess]:
    """Start every command at once (their imports overlap), then collect them."""
    procs = {
        name: subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        for name, cmd in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.mark.slow  # one subprocess per surface
def test_a_mistyped_device_is_one_line_everywhere(tmp_path):
    vlinfer = [sys.executable, "-m", "vlinfer"]
    commands = {
        "generate": [*vlinfer, "generate", "hi", "--device", "cdua"],
        "chat": [*vlinfer, "chat", "--device", "cdua"],
        "caption": [
            *vlinfer, "caption", IMAGE, "--out",
            str(tmp_path / "c.jsonl"), "--device", "cdua"
        ],
        "serve": [*vlinfer, "serve", "--device", "cdua"],
        "-v after": [*vlinfer, "generate", "hi", "--device", "cdua", "-v"],
        # handed on to the server's parser
        "serve -v before": [*vlinfer, "-v", "serve", "--device", "cdua"],
        "demo": [sys.executable,
                 os.path.join(REPO, "apps", "demo.py"), "--device", "cdua"],
    }
    for name, res in _run_all(commands).items():
        assert res.returncode == 2, (name, res.stderr[-2000:])
        assert "Traceback" not in res.stderr, (name, res.stderr[-2000:])
        lines = res.stderr.strip().splitlines()
        # their log lines may come first: the error is last
        if name in ("serve", "serve -v before", "demo"):
            assert lines[-1] == DEVICE_ERROR, (name, res.stderr[-2000:])
        else:
            assert lines == [DEVICE_ERROR], (name, res.stderr[-2000:])


@pytest.mark.slow  # one subprocess per surface
def test_cli_errors_and_warnings_name_flags(tiny_vl_with_context):
    """The KV budget refusal and the fitted-length warning, through the CLI: flags, not keyword
    arguments."""
    model = tiny_vl_with_context(262144)
    vlinfer = [sys.executable, "-m", "vlinfer"]
    common = ["--model", model, "--dtype", "float32", "--device", "cpu", "--max-tokens", "2"]
    results = _run_all({
        "too small": [
            *vlinfer, "generate", "hi", *common, "--max-model-len", "8192", "--kv-cache-size", "1M"
        ],
        "fitted": [*vlinfer, "generate", "hi", *common, "--kv-cache-size", "3M"],
    })
    res = results["too small"]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    error = res.stderr.strip().splitlines()[-1]
    assert error.startswith("error: KV cache budget of 1048576 bytes holds"), error
    assert "fewer than one sequence of --max-model-len=8192 needs (512); raise --kv-cache-size / " \
           "--memory-utilization, lower --max-model-len" in error
    assert "kv_cache_bytes" not in error and "max_model_len" not in error
    res = results["fitted"]
    assert res.returncode == 0, res.stderr[-2000:]
    warning = next(line for line in res.stderr.splitlines() if "the KV cache" in line)
    assert warning.startswith("WARNING --max-model-len=3072: the KV cache"), warning
    assert "the default --max-model-len cap=8192" in warning \
        and "raise --kv-cache-size or --memory-utilization" in warning, warning


def test_serve_on_a_busy_port_fails_before_the_model_loads(capsys):
    """`vlinfer serve` on a port another process holds: exit 2 naming --port, before the model is
    looked for (fails today: the model loads first, and here is not found)."""
    import socket
    from vlinfer.cli import serve as serve_cli
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = serve_cli.main(["--model", "no-such-model-anywhere", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"--port {port} on 127.0.0.1 cannot be used" in err, err
    assert "no-such-model-anywhere" not in err
