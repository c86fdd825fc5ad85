"""The wheel's build steps beyond pyproject.toml: the CPU kernels compiled for every instruction-set
level into vlinfer/ops/cpu/prebuilt/ (loader.write_prebuilt, the same build the JIT path runs, so a
level already in torch's extension cache is reused), and the torch requirement pinned to the series
they were built against. An editable install builds nothing here (its kernels are JIT-compiled)."""
import importlib.util
import os
import sys

import torch
from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
DEPENDENCIES = [
    "torchvision",
    "transformers>=5.25",  # its Qwen3VLProcessor is our oracle for video prompts
    "safetensors",
    "huggingface_hub",
    "pillow",
    "tqdm",
    "httpx",  # image URLs: the engine (allow_image_urls=True) and the server fetch them alike
    "ninja",  # JIT-compiles the CPU kernels where no prebuilt library fits (loader.py)
]


def _loader():
    """vlinfer/ops/cpu/loader.py of this source tree, without importing the package's ops."""
    sys.path.insert(0, ROOT)  # its `vlinfer.platform` import: this tree's
    spec = importlib.util.spec_from_file_location(
        "vlinfer_build_loader", os.path.join(ROOT, "vlinfer", "ops", "cpu", "loader.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):

    def run(self):
        super().run()
        if not self.editable_mode:
            _loader().write_prebuilt(
                os.path.join(self.build_lib, "vlinfer", "ops", "cpu", "prebuilt"))


class BinaryDistribution(Distribution):
    """Shared libraries inside: a wheel for this platform and Python, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=BinaryDistribution,
      install_requires=[_loader().torch_requirement(torch.__version__), *DEPENDENCIES])
