"""Graph mode on CUDA: decode steps captured and replayed as CUDA graphs (torch.cuda.CUDAGraph), for
the engine's graph runner (engine/graph_runner.py keeps the buckets and static buffers; this records
and replays a forward).

A decode step can be captured only where every op in it is free of host syncs: CudaOps with the
Triton cache write (backend.py). The reference ops read lengths on the host (.tolist()) and cannot
be captured."""
import torch

from vlinfer.ops.interface import GraphModeUnavailable


class CudaGraphBackend:
    name = "CUDA graphs"

    def __init__(self, device: torch.device, ops):
        self.device, self.ops = device, ops
        # one memory pool shared by every bucket's graph (they never replay at once)
        self.pool = None

    def reads_only_used_blocks(self, block_size: int, dtype: torch.dtype) -> bool:
        return self.ops.decode_reads_only_used_blocks(block_size, dtype)

    def capture(self, fn):
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize(self.device)
        return CudaGraph(graph, output)


class CudaGraph:
    def __init__(self, graph, output: torch.Tensor):
        self.graph, self.output = graph, output

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output  # the static output: read it before the next replay


def backend(device: torch.device, ops) -> CudaGraphBackend:
    """The CUDA graph backend over the engine's CudaOps, or GraphModeUnavailable (logged by the
    graph runner, which runs eager)."""
    if ops.features.get("cache_write") != "triton":
        raise GraphModeUnavailable(
            "the KV cache write is the pure-torch reference (Triton unavailable), which "
            "syncs with the host")
    return CudaGraphBackend(device, ops)
