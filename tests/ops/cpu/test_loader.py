"""vlinfer/ops/cpu/loader.py: a wheel's prebuilt kernels are loaded when they fit the running torch
and the installed sources, JIT-compiled otherwise with the reason in the log, and a library in
torch's extension cache is reused by its build key whatever the source paths it was built from.
The prebuilt folder here is written by write_prebuilt (the wheel build's function) for this CPU's
level only, from the cache the other kernel tests use."""
import json
import logging
import os
import shutil

import pytest
import torch

from vlinfer.ops.cpu import loader
from vlinfer.platform import cpu_features

ISA = cpu_features.cpu_isa()


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prebuilt")
    manifest = loader.write_prebuilt(str(directory), levels=(ISA,))
    return directory, manifest


@pytest.fixture
def wheel(prebuilt, monkeypatch, tmp_path):
    """A copy of the prebuilt folder as the package's, and a JIT path that records its calls."""
    directory, _ = prebuilt
    copy = tmp_path / "prebuilt"
    shutil.copytree(directory, copy)
    monkeypatch.setattr(loader, "PREBUILT_DIR", str(copy))
    compiled = []
    compile_library = loader.compile_library

    def recording(isa, extension="cpu"):
        compiled.append((isa, extension))
        return compile_library(isa, extension)
    monkeypatch.setattr(loader, "compile_library", recording)
    # the library the loader chose (a process that imported one of the same name before gets
    # that module back from Python, whichever file is asked for)
    imported = []
    import_library = loader._import
    monkeypatch.setattr(loader, "_import", lambda path: imported.append(path) or
                        import_library(path))
    return copy, compiled, imported


def _edit_manifest(folder, edit):
    path = folder / loader.MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("extension", list(loader.EXTENSIONS))
def test_a_fitting_prebuilt_library_is_loaded_and_nothing_compiles(wheel, extension, caplog):
    folder, compiled, imported = wheel
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        module = loader.load(ISA, extension)
    assert f"kernels: prebuilt {ISA} {extension} from {folder / ISA}" in caplog.text
    assert "JIT" not in caplog.text and compiled == []
    assert [os.path.dirname(path) for path in imported] == [str(folder / ISA)]
    # the module's own functions answer
    assert module.isa() if extension == "gguf" else module.decode_attention_kernels()


def test_the_manifest_records_the_torch_version_and_every_extension(prebuilt):
    _, manifest = prebuilt
    assert manifest["torch"] == torch.__version__
    assert set(manifest["levels"][ISA]) == set(loader.EXTENSIONS)
    for extension, entry in manifest["levels"][ISA].items():
        assert entry["digest"] == loader.source_digest(ISA, extension)


@pytest.mark.parametrize("edit, why", [
    (lambda m: m.update(torch="2.99.0"),
     f"the prebuilt kernels were built against torch 2.99.0, this is torch {torch.__version__}"),
    (lambda m: m["levels"][ISA]["cpu"].update(digest="0" * 32),
     "the installed kernel sources differ from those the prebuilt kernels built"),
    (lambda m: m["levels"].pop(ISA), f"the wheel has no prebuilt cpu kernels for {ISA}"),
])
def test_a_prebuilt_library_that_does_not_fit_is_jit_compiled_saying_why(wheel, edit, why, caplog):
    folder, compiled, imported = wheel
    _edit_manifest(folder, edit)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        loader.load(ISA, "cpu")
    _, _, library = loader._cached(ISA, "cpu")
    assert imported == [library] and compiled == []  # the cache's library, built before
    assert f"kernels: JIT-compiled vlinfer_cpu_kernels_{ISA} ({why}) from " in caplog.text
    assert all(r.levelno == logging.WARNING for r in caplog.records if "JIT" in r.message)


@pytest.mark.parametrize("cached", [True, False])
def test_an_editable_install_jit_compiles_and_says_so(wheel, monkeypatch, tmp_path, caplog, cached):
    """Built before: taken from torch's extension cache; never built: compiled (the build stood in
    for by the cached library)."""
    _, compiled, imported = wheel
    monkeypatch.setattr(loader, "PREBUILT_DIR", str(tmp_path / "absent"))
    directory, _, library = loader._cached(ISA, "cpu")
    if not cached:
        monkeypatch.setattr(loader, "_cached", lambda isa, extension: (directory, {}, None))
        monkeypatch.setattr(loader, "compile_library",
                            lambda isa, extension: compiled.append((isa, extension)) or library)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        loader.build_extension(ISA)
    assert compiled == ([] if cached else [(ISA, "cpu")]) and imported == [library]
    word, where = ("JIT-compiled", "from") if cached else ("JIT-compiling", "into")
    assert (f"kernels: {word} vlinfer_cpu_kernels_{ISA} (editable install: no prebuilt kernels "
            f"in the package) {where} {directory}") in caplog.text


def test_the_cache_is_reused_by_build_key_and_rebuilt_when_the_key_changes(monkeypatch):
    """The second build of a level finds its stamp and never calls torch's builder (which would run
    ninja, and rebuild a library built from other source paths); a changed source digest calls
    it."""
    library = loader.compile_library(ISA, "gguf")
    from torch.utils import cpp_extension
    calls = []

    def builder(name, *args, **kwargs):
        calls.append(name)
        raise RuntimeError("torch's builder ran")
    monkeypatch.setattr(cpp_extension, "load", builder)
    assert loader.compile_library(ISA, "gguf") == library and calls == []
    monkeypatch.setattr(loader, "source_digest", lambda isa, extension: "changed")
    with pytest.raises(RuntimeError, match="torch's builder ran"):
        loader.compile_library(ISA, "gguf")
    assert calls == [f"vlinfer_gguf_kernels_{ISA}"]


def test_the_wheel_pins_the_torch_series_it_was_built_against():
    assert loader.torch_requirement("2.14.1+cpu") == "torch>=2.14,<2.15"
    assert loader.torch_requirement("3.0.0") == "torch>=3.0,<3.1"
    assert loader.torch_series("2.14.1") == loader.torch_series("2.14.0")
    with pytest.raises(ValueError, match="cannot read a torch version"):
        loader.torch_series("nightly")


def test_every_dispatcher_level_has_flags_and_an_unknown_level_is_refused():
    assert tuple(loader.ISA_FLAGS) == cpu_features.CPU_ISAS
    with pytest.raises(ValueError, match="unknown CPU kernel level 'amx'; expected one of generic"):
        loader.source_digest("amx", "cpu")
