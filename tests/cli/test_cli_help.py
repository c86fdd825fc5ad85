"""`--help` answers at once and reads in order: building the parsers imports neither torch, the
engine nor the server's web stack, and each help shows the options most runs set first, the engine
settings and limits after them under "advanced options"."""
import os
import re
import subprocess
import sys

import pytest

from dependencies import REPO

HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "vlinfer.engine")
PROBE = """
import runpy, sys
sys.argv = ["vlinfer", *sys.argv[1:]]
try:
    runpy.run_module("vlinfer", run_name="__main__")
except SystemExit:
    pass
print("LOADED", sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["caption", "--help"],
                                  ["generate", "--help"], ["embed", "--help"]],
                         ids=lambda argv: " ".join(argv))
def test_help_imports_no_torch_engine_or_web_stack(argv):
    run = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert "usage:" in run.stdout, run.stderr[-2000:]
    assert "LOADED []" in run.stderr, run.stderr[-2000:]


def _sections(text: str) -> tuple[str, str]:
    """(the common options, the advanced ones) of a help text."""
    common, advanced = text.split("\nadvanced options:\n", 1)
    return common, advanced


@pytest.mark.parametrize("argv, common, advanced", [
    (["serve", "--help"], ["--model", "--host", "--port", "--api-key", "--chat-template"],
     ["--device", "--kv-cache-size", "--max-image-bytes", "--lora-modules"]),
    (["caption", "--help"], ["--out", "--prompt", "--json-schema", "--model", "--temperature"],
     ["--device", "--kv-cache-size", "--tensor-parallel-size"]),
], ids=["serve", "caption"])
def test_help_puts_common_options_first_and_the_rest_under_advanced(argv, common, advanced,
                                                                     capsys):
    from vlinfer.cli import main
    with pytest.raises(SystemExit):
        main(argv)
    text = capsys.readouterr().out
    first, rest = _sections(text)
    flags = lambda section: set(re.findall(r"^  (--[\w-]+)", section, re.M))  # noqa: E731
    assert set(common) <= flags(first) and not set(common) & flags(rest)
    assert set(advanced) <= flags(rest) and not set(advanced) & flags(first)
    assert len(text.split("\n", 1)[0]) < 100  # usage: one short line, the help lists the rest
