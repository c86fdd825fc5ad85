"""The CPU backend: `CpuOps` (backend.py) on our C++ kernels (csrc/, built by loader.py), one file
per op family."""
from vlinfer.ops.cpu.backend import CpuOps

__all__ = ["CpuOps"]
