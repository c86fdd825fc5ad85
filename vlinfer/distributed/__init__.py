"""Tensor parallelism across processes: rendezvous, the control channel, rank 0's driver. The worker loop is
vlinfer/engine/worker.py; the sharded layers are vlinfer/layers/."""
from vlinfer.distributed.comm import ParallelConfig, TensorParallelError
from vlinfer.distributed.driver import TPDriver

__all__ = ["ParallelConfig", "TPDriver", "TensorParallelError"]
