"""Ops: what layers compute, one backend package per device (reference/, cpu/, cuda/, npu/).
interface.py is the contract every table follows, select.py picks one table per engine; the engine,
layers and models see only these."""
from vlinfer.ops.interface import OPS, QUESTIONS, Backend, GraphModeUnavailable, PerStep
from vlinfer.ops.reference import ReferenceOps
from vlinfer.ops.select import IMPLEMENTATIONS, default_block_size, select

__all__ = ["IMPLEMENTATIONS", "OPS", "QUESTIONS", "Backend", "GraphModeUnavailable", "PerStep",
           "ReferenceOps", "default_block_size", "select"]
