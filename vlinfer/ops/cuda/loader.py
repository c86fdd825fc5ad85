"""Our Triton kernels (triton/*.py, package data of vlinfer.ops.cuda) as modules, and the one way
CudaOps loads them: lazily, checked against the reference on a tiny problem, the outcome recorded
and any failure logged.

Modules are loaded by file path under a private name (the triton folder is not a package), afresh on
each call, because triton reads TRITON_INTERPRET when the kernels are decorated (the tests run them
under the interpreter, the GPU under the compiler)."""
import importlib.util
import logging
import os

logger = logging.getLogger("vlinfer")
KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton")


def load_triton_module(name: str):
    """triton/<name>.py as the module `_vlinfer_triton_<name>`."""
    source = os.path.join(KERNEL_DIR, f"{name}.py")
    if not os.path.exists(source):
        raise FileNotFoundError(
            f"kernel source {source} is missing (the package was built without its data)")
    spec = importlib.util.spec_from_file_location(f"_vlinfer_triton_{name}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def error_reason(e: Exception) -> str:
    """An exception as one short log phrase: its type and the first line of its message."""
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class TritonKernels:
    """One op table's Triton kernels, each loaded and checked the first time it is asked for (a
    dense model never compiles the MoE or quantized kernels). `features[key]` records the outcome:
    "triton", or "reference" after a warning that says why and what runs instead; a kernel that
    failed is not tried again."""

    def __init__(self, features: dict):
        self.features = features  # the op table's own record (CudaOps.features)
        self._kernels: dict = {}

    def get(self, key: str, load, what: str, instead: str):
        """The kernel load() returns (it loads and checks; it raises on a missing Triton, no driver,
        a kernel that compiles or computes wrong), or None where it raised."""
        if key not in self.features:
            try:
                self._kernels[key], self.features[key] = load(), "triton"
            except Exception as e:
                self._kernels[key], self.features[key] = None, "reference"
                logger.warning("ops[cuda]: Triton %s unavailable (%s); %s", what, error_reason(e),
                               instead)
        return self._kernels[key]
