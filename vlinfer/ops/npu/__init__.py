"""The Ascend NPU backend: `NpuOps` (backend.py) on torch_npu's fused operators, one file per op
family, and its graph mode (graph.py). torch_npu is imported when an NpuOps is made, not here."""
from vlinfer.ops.npu.backend import NpuOps

__all__ = ["NpuOps"]
