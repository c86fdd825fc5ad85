"""Our Triton kernels (kernels/triton/*.py) as modules: loaded by file path under a private name (the repository's
`kernels` folder is not a package), afresh on each call, because triton reads TRITON_INTERPRET when the kernels are
decorated (the tests run them under the interpreter, the GPU under the compiler)."""
import importlib.util
import os

KERNEL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "triton")


def load_triton_module(name: str):
    """kernels/triton/<name>.py as the module `_vlinfer_triton_<name>`."""
    source = os.path.abspath(os.path.join(KERNEL_DIR, f"{name}.py"))
    if not os.path.exists(source):
        raise FileNotFoundError(f"kernel source {source} is missing (vlinfer must run from its source tree)")
    spec = importlib.util.spec_from_file_location(f"_vlinfer_triton_{name}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
