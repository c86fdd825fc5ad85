"""Graph mode on the Ascend NPU: decode steps captured and replayed as ACL graphs (torch.npu.NPUGraph), the
FULL_DECODE_ONLY way (docs/npu-ops.md §5.4): only decode-only steps replay, prefill and mixed steps run eager.

What differs from CUDA graphs (graph_runner.CudaGraphBackend):
- FIA computes its tiling from host-side lengths (actual_seq_lengths_kv is a Python int list, §1), which a graph
  would replay as captured. So each layer's attention is captured as its own task group, and before every replay
  each group is re-issued with the step's lengths on an update stream (graph_task_update_begin/end), ordered before
  the replayed task by an ExternalEvent (vlinfer/ops/npu_graph.py). The graph runner hands the step's
  lengths over as a host list (`host_lengths`): no device->host copy per step.
- The NPU cache writes take no -1 slots and FIA's empty-KV case is a special one (§2.1, §2.3), so padded rows write
  to a reserved dummy block at the end of the KV pool and attend to one slot of it (§5.3, §7.1; `pads_to_dummy_block`,
  allocated by the model runner).

torch_npu 2.14 also ships handlers that patch these lengths automatically (torch_npu/npu/_npugraph_handlers/, §5.4).
npu-ops.md names them but not how they are driven, so they are not relied on: the explicit update above runs either
way, and their presence is only logged.

The backend drives the engine's NpuOps instance: its `capturing` while a graph is captured, its
`update_graph_attention` before each replay. Nothing here has run on an NPU; tests/fake_torch_npu.py emulates the
graph APIs as the note documents them.
"""
import importlib.util
import logging

import torch

from vlinfer.engine.graph_backend import GraphModeUnavailable
from vlinfer.ops import ReferenceOps
from vlinfer.ops.npu import GraphCapture, NpuOps

logger = logging.getLogger("vlinfer")


class AclGraphBackend:
    name = "ACL graphs (torch.npu.NPUGraph, attention re-issued with each step's lengths)"
    host_lengths = True  # capture(fn, seq_lens) and replay(seq_lens) take the rows' KV lengths as a host list
    pads_to_dummy_block = True

    def __init__(self, device: torch.device, ops: NpuOps):
        self.device, self.ops = device, ops
        self.pool = None  # one memory pool shared by every bucket's graph (they never replay at once)
        self.update_stream = torch.npu.Stream(device=device)

    def reads_only_used_blocks(self, block_size: int, dtype: torch.dtype) -> bool:
        # FIA reads only the first ceil(len / block_size) entries of a block-table row (§1): the captured width costs
        # no memory, so graphs serve contexts up to max_model_len.
        return True

    def capture(self, fn, seq_lens: list[int]):
        torch.npu.synchronize()
        graph = torch.npu.NPUGraph()
        capture = GraphCapture(seq_lens)
        with self.ops.capturing(capture), torch.npu.graph(graph, pool=self.pool):
            output = fn()
        if self.pool is None:
            self.pool = graph.pool()
        torch.npu.synchronize()
        if not capture.tasks:
            raise RuntimeError("no attention task was captured")
        return _AclGraph(graph, output, capture, self.ops, self.update_stream)


class _AclGraph:
    def __init__(self, graph, output: torch.Tensor, capture: GraphCapture, ops: NpuOps, update_stream):
        self.graph, self.output, self.capture, self.ops, self.update_stream = graph, output, capture, ops, update_stream

    def replay(self, seq_lens: list[int]) -> torch.Tensor:
        # The updates rewrite tasks of this graph: let them start after everything queued before (the previous
        # replay of the same graph included).
        self.update_stream.wait_stream(torch.npu.current_stream())
        self.ops.update_graph_attention(self.capture, seq_lens, self.update_stream)
        self.graph.replay()
        return self.output  # the static output: read it before the next replay


def backend(device: torch.device, ops: ReferenceOps) -> AclGraphBackend:
    """The ACL graph backend over the engine's op table, or GraphModeUnavailable (logged by
    graph_runner.select_backend, which runs eager)."""
    if not isinstance(ops, NpuOps):
        raise GraphModeUnavailable(f"the {ops.name} ops read sequence lengths on the host")
    missing = ops.graph_features()
    if missing:
        raise GraphModeUnavailable(f"this torch_npu lacks {', '.join(missing)}")
    try:
        handlers = importlib.util.find_spec("torch_npu.npu._npugraph_handlers") is not None
    except (ImportError, ValueError, AttributeError):
        handlers = False
    if handlers:
        logger.info("graph mode: torch_npu ships _npugraph_handlers; attention tasks are still updated explicitly "
                    "each replay (npu-ops.md §5.4 does not document how the handlers are driven)")
    return AclGraphBackend(device, ops)
