"""The CUDA backend: `CudaOps` (backend.py) on our Triton kernels (triton/, loaded by loader.py) and
flash_attn, one file per op family, and its graph mode (graph.py)."""
from vlinfer.ops.cuda.backend import CudaOps

__all__ = ["CudaOps"]
