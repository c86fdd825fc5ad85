"""Ops: what layers compute, one implementation per device. `select(device_type)` returns a new op table (an
instance of reference.ReferenceOps or a device subclass) that one engine owns; reference.py defines every op."""
from vlinfer.ops.dispatch import IMPLEMENTATIONS, OPS, select
from vlinfer.ops.reference import ReferenceOps

__all__ = ["IMPLEMENTATIONS", "OPS", "ReferenceOps", "select"]
