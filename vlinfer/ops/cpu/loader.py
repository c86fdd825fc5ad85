"""The CPU kernels' loader: where the C++ sources live (csrc/), the compiler flags per
instruction-set level (cpu_features.CPU_ISAS), and the one build of each extension (the main
kernels, the GGUF block kernels) per level with torch's extension builder. Explicit -m flags rather
than -march=native: a build must not depend on the machine that compiles it, only on the level.

A wheel carries every level prebuilt (setup.py calls `write_prebuilt`, which builds through
`compile_library` as the JIT path does and copies the libraries into prebuilt/<level>/ with a
manifest of the torch version and the sources' digest); `load` imports the prebuilt library when the
manifest matches the running torch and the installed sources, and JIT-compiles otherwise (an
editable install, or a mismatch), saying which in the log.

`build_this_cpu` builds this CPU's level into torch's extension cache (make install runs it, so
the first run does not compile)."""
import glob
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass

import torch

from vlinfer.platform import cpu_features

logger = logging.getLogger("vlinfer")

# Inside the package (package data, pyproject.toml), so an installed wheel has the sources its
# prebuilt libraries were built from, and the JIT fallback builds the same kernels as a checkout.
CPU_KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
PREBUILT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prebuilt")
MANIFEST = "manifest.json"
# Beside each library in torch's extension cache: the build key it was built with, so a build from
# other source paths (a wheel built from a copy) reuses it where ninja would rebuild it.
STAMP = "vlinfer_build.json"
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
AVX512_FLAGS = AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
# every dispatcher level (cpu_features.CPU_ISAS) needs its flags here: tests/ops/cpu/test_loader.py
ISA_FLAGS = {"generic": (), "avx2": AVX2_FLAGS, "avx512": AVX512_FLAGS,
             "avx512bf16": AVX512_FLAGS + ("-mavx512bf16", "-mavx512vnni")}


@dataclass(frozen=True)
class Extension:
    prefix: str  # the module is f"{prefix}_{isa}": torch's cache is keyed by name, one per level
    sources: tuple[str, ...]
    cflags: tuple[str, ...]


EXTENSIONS = {
    "cpu": Extension("vlinfer_cpu_kernels", tuple(
        os.path.join(CPU_KERNEL_DIR, name)
        for name in ("paged_ops.cpp", "attention_bf16.cpp", "moe_experts.cpp", "panel_linear.cpp",
                     "decode_layer.cpp", "kv_quant.cpp", "lora_panels.cpp",
                     "linear_attention.cpp", "linear_attention_prefill.cpp", "int8_vnni.cpp")),
        ("-O3", "-fopenmp", "-ffast-math")),
    # -ffp-contract=off: embedding rows are dequantized exactly as gguf-py does (gguf.py)
    "gguf": Extension("vlinfer_gguf_kernels", (os.path.join(CPU_KERNEL_DIR, "gguf_blocks.cpp"),),
                      ("-O3", "-fopenmp", "-ffp-contract=off")),
}
SOURCES = EXTENSIONS["cpu"].sources


def torch_series(version: str) -> str:
    """"2.14.1+cpu" -> "2.14": the wheel pins it and the prebuilt libraries need it (patch
    releases keep the C++ ABI the extensions link against)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return f"{match[1]}.{match[2]}"


def torch_requirement(version: str) -> str:
    """The wheel's torch requirement: the series its libraries were built against."""
    major, minor = map(int, torch_series(version).split("."))
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


def _flags(isa: str, extension: str) -> list[str]:
    if isa not in ISA_FLAGS:
        raise ValueError(
            f"unknown CPU kernel level {isa!r}; expected one of {', '.join(ISA_FLAGS)}")
    spec = EXTENSIONS[extension]
    # torch keys its build cache by the sources' contents and the flags, not by the headers they
    # include: a digest of the headers in the flags makes a changed header rebuild too.
    headers = sorted(glob.glob(os.path.join(CPU_KERNEL_DIR, "*.h")))
    digest = hashlib.sha256(b"".join(open(h, "rb").read() for h in headers)).hexdigest()[:16]
    return [*spec.cflags, *ISA_FLAGS[isa], f"-DVLINFER_HEADERS_DIGEST={digest}"]


def source_digest(isa: str, extension: str) -> str:
    """What the library's code depends on in this package: the sources' and headers' contents
    and the flags (not their paths)."""
    for source in EXTENSIONS[extension].sources:
        if not os.path.exists(source):
            raise FileNotFoundError(
                f"kernel source {source} is missing (the package was built without its data)")
    digest = hashlib.sha256(json.dumps(_flags(isa, extension)).encode())
    for source in EXTENSIONS[extension].sources:
        with open(source, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:32]


def _build_key(isa: str, extension: str) -> dict:
    return {"digest": source_digest(isa, extension), "torch": torch.__version__,
            "python": sys.implementation.cache_tag}


def _cached(isa: str, extension: str) -> tuple[str, dict, str | None]:
    """(this extension's folder in torch's extension cache, its build key, the library built there
    with that key or None)."""
    from torch.utils import cpp_extension
    # torch's own choice of folder (TORCH_EXTENSIONS_DIR, else its per-Python default)
    directory = cpp_extension._get_build_directory(f"{EXTENSIONS[extension].prefix}_{isa}", False)
    key = _build_key(isa, extension)
    stamp = os.path.join(directory, STAMP)
    if os.path.exists(stamp):
        with open(stamp) as f:
            built = json.load(f)
        if built.get("key") == key and os.path.exists(built.get("library", "")):
            return directory, key, built["library"]
    return directory, key, None


def compile_library(isa: str, extension: str = "cpu") -> str:
    """Build one extension for one level with torch's extension builder (first time for this
    key in torch's extension cache, TORCH_EXTENSIONS_DIR); the path of its shared library. The JIT
    path and the wheel build both come here."""
    from torch.utils import cpp_extension
    directory, key, library = _cached(isa, extension)
    if library is not None:
        return library
    library = cpp_extension.load(f"{EXTENSIONS[extension].prefix}_{isa}",
                                 list(EXTENSIONS[extension].sources),
                                 extra_cflags=_flags(isa, extension), extra_ldflags=["-fopenmp"],
                                 build_directory=directory, is_python_module=False, verbose=False)
    stamp = os.path.join(directory, STAMP)
    written = f"{stamp}.{os.getpid()}"
    with open(written, "w") as f:
        json.dump({"key": key, "library": library}, f)
    os.replace(written, stamp)  # a concurrent reader sees the old stamp or the new one
    return library


def _import(path: str):
    """The extension module in a shared library, imported by path as torch's loader does."""
    module_name = os.path.basename(path).split(".")[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prebuilt(isa: str, extension: str) -> tuple[str | None, str]:
    """(the prebuilt library to load, None where there is none that fits; why not)."""
    manifest_path = os.path.join(PREBUILT_DIR, MANIFEST)
    if not os.path.exists(manifest_path):
        return None, "editable install: no prebuilt kernels in the package"
    with open(manifest_path) as f:
        manifest = json.load(f)
    entry = manifest["levels"].get(isa, {}).get(extension)
    if entry is None:
        return None, f"the wheel has no prebuilt {extension} kernels for {isa}"
    if torch_series(manifest["torch"]) != torch_series(torch.__version__):
        return None, (f"the prebuilt kernels were built against torch {manifest['torch']}, this is "
                      f"torch {torch.__version__}")
    if manifest["python"] != sys.implementation.cache_tag:
        return None, (f"the prebuilt kernels were built for {manifest['python']}, this is "
                      f"{sys.implementation.cache_tag}")
    if entry["digest"] != source_digest(isa, extension):
        return None, "the installed kernel sources differ from those the prebuilt kernels built"
    return os.path.join(PREBUILT_DIR, isa, entry["library"]), ""


def load(isa: str, extension: str = "cpu"):
    """The kernels of one extension for one level: the wheel's prebuilt library where it fits the
    running torch and the installed sources, else compiled now (JIT), logged either way."""
    library, why = _prebuilt(isa, extension)
    if library is not None:
        logger.info("kernels: prebuilt %s %s from %s", isa, extension, os.path.dirname(library))
        return _import(library)
    log = logger.warning if os.path.exists(os.path.join(PREBUILT_DIR, MANIFEST)) else logger.info
    directory, _, cached = _cached(isa, extension)
    log("kernels: %s %s_%s (%s) %s %s", "JIT-compiled" if cached else "JIT-compiling",
        EXTENSIONS[extension].prefix, isa, why, "from" if cached else "into", directory)
    return _import(cached or compile_library(isa, extension))


def build_extension(isa: str):
    """The main CPU kernels for one instruction-set level (backend.py)."""
    return load(isa, "cpu")


def write_prebuilt(directory: str, levels=cpu_features.CPU_ISAS) -> dict:
    """Every extension at every level, built through compile_library (torch's extension cache:
    a level built before, by the JIT path or an earlier wheel, is reused) and copied into
    directory/<level>/, with the manifest `load` checks. The wheel build (setup.py) calls it."""
    manifest = {"torch": torch.__version__, "python": sys.implementation.cache_tag, "levels": {}}
    for isa in levels:
        os.makedirs(os.path.join(directory, isa), exist_ok=True)
        for extension in EXTENSIONS:
            library = compile_library(isa, extension)
            shutil.copy2(library, os.path.join(directory, isa, os.path.basename(library)))
            manifest["levels"].setdefault(isa, {})[extension] = {
                "library": os.path.basename(library), "digest": source_digest(isa, extension)}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def build_every_level() -> None:
    """Every extension at every level the dispatcher knows, into torch's extension cache (CI warms
    it in the background while the default tests run; the slow tier's kernel and wheel tests
    then find each level built)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for isa in cpu_features.CPU_ISAS:
        for extension in EXTENSIONS:
            logger.info("kernels: %s %s in %s", isa, extension, compile_library(isa, extension))


def build_this_cpu() -> None:
    """Every extension at this CPU's level, into torch's extension cache (make install)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in EXTENSIONS:
        load(cpu_features.cpu_isa(), name)
