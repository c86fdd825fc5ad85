"""Tensor parallelism across processes: rendezvous, the control channel, rank 0's driver. The worker
loop is vlinfer/engine/worker.py; the sharded layers are vlinfer/layers/."""
from vlinfer.distributed.comm import ParallelConfig, TensorParallelError
from vlinfer.distributed.driver import TPDriver
from vlinfer.distributed.shapes import check_tensor_parallel_shapes

__all__ = ["ParallelConfig", "TPDriver", "TensorParallelError", "check_tensor_parallel_shapes"]
