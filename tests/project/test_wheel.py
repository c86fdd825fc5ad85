"""The built wheel carries what vlinfer loads from its own files: the kernel sources
(vlinfer/ops/cpu/csrc, cuda/triton, built or loaded by path at first use), the chat templates and
the embedded toy with its embedder's tensors. Built from a copy of the checkout, installed with
--no-deps into a fresh venv outside it, whose dependencies come from the repository's .venv by a
.pth line (no second torch install) while .venv's editable vlinfer stays invisible: paths a .pth
file lists are added to sys.path after the venv's own site-packages and their own .pth files (the
editable finder's) are never run. From there the engine must run the compiled CPU op table, not the
reference, and examples/quickstart.py must run.

The CPU kernels compile once in a private TORCH_EXTENSIONS_DIR (minutes on 2 cores): torch's cache
is keyed by the extension's name, and building the same name from the wheel's source paths in the
shared cache would rebuild it in place under other processes (ninja sees changed commands), and the
checkout's next run would rebuild it back."""
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from dependencies import REPO

CHECK = textwrap.dedent("""
    import os, sys
    import vlinfer
    from vlinfer import LLM
    from vlinfer.ops.cpu import loader as cpu
    from vlinfer.ops.cuda import loader as triton_source
    from vlinfer.toy import embedded
    venv = sys.argv[1]
    toy_files = [os.path.join(embedded.PACKAGE_DIR, name) for name in
                 (embedded.WEIGHTS, embedded.MANIFEST, embedded.EMBEDDER_WEIGHTS,
                  embedded.EMBEDDER_MANIFEST)]
    for path in (vlinfer.__file__, *cpu.SOURCES, triton_source.KERNEL_DIR, *toy_files):
        assert os.path.realpath(path).startswith(venv), f"{path} is not the wheel's (venv {venv})"
        assert os.path.exists(path), f"{path} is missing from the wheel"
    assert not [m for m in sys.modules if "__editable__" in m], \
        "the checkout's editable finder is loaded"
    llm = LLM("qwen3-vl-tiny")
    assert llm.engine.ops_implementation == "cpu-compiled", llm.engine.ops_implementation
    print("ops", llm.engine.ops_implementation)
""")


def _run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, \
        f"{args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_installed_wheel_runs_the_compiled_kernels_and_the_quickstart(tmp_path):
    assert not str(tmp_path).startswith(REPO)
    # Build from a copy (tracked and new files, as a clean clone would have them): setuptools writes
    # build/ and *.egg-info next to the sources, and the checkout is shared.
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                 cwd=REPO).stdout
    source = tmp_path / "source"
    for name in filter(None, files.split("\0")):
        # a file deleted in the working tree is still in the index
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(source / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), source / name)
    _run([
        sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w",
        str(tmp_path / "dist")
    ], cwd=source)
    (wheel,) = (tmp_path / "dist").glob("vlinfer-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
         str(wheel)])
    site = _run([python, "-c",
                 "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    with open(os.path.join(site, "repo_dependencies.pth"), "w") as f:
        # this .venv's site-packages: torch, transformers, ...
        f.write(sysconfig.get_path("purelib") + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")
    out = _run([python, "-c", CHECK, os.path.realpath(venv)], cwd=tmp_path, env=env, timeout=1200)
    assert "ops cpu-compiled" in out.stdout

    examples = tmp_path / "examples"
    os.makedirs(examples / "images")
    shutil.copy2(os.path.join(REPO, "examples", "quickstart.py"), examples)
    shutil.copy2(os.path.join(REPO, "examples", "images", "red_house.png"), examples / "images")
    out = _run([python, str(examples / "quickstart.py")], cwd=tmp_path, env=env, timeout=1200)
    assert "[image]" in out.stdout and "[text]" in out.stdout and "done in" in out.stdout, \
        out.stdout
    assert "[search] 'a red house' among 1 pictures" in out.stdout \
        and "red_house.png (cosine" in out.stdout
