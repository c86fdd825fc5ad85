"""Graph mode on the Ascend NPU: decode steps captured and replayed as ACL graphs
(torch.npu.NPUGraph), the FULL_DECODE_ONLY way (docs/npu-ops.md §5.4): only decode-only steps
replay, prefill and mixed steps run eager. The engine's graph runner (engine/graph_runner.py) keeps
the buckets and static buffers and asks NpuOps.graph_capture for the backend below.

What differs from CUDA graphs (ops/cuda/graph.py):
- FIA computes its tiling from host-side lengths (actual_seq_lengths_kv is a Python int list, §1),
  which a graph would replay as captured. So each layer's attention is captured as its own task
  group, and before every replay each group is re-issued with the step's lengths on an update stream
  (graph_task_update_begin/end), ordered before the replayed task by an ExternalEvent. The graph
  runner hands the step's lengths over as a host list (`host_lengths`): no device->host copy per
  step.
- The NPU cache writes take no -1 slots and FIA's empty-KV case is a special one (§2.1, §2.3), so
  padded rows write to a reserved dummy block at the end of the KV pool and attend to one slot of it
  (§5.3, §7.1; `pads_to_dummy_block`, allocated by the model runner).

torch_npu 2.14 also ships handlers that patch these lengths automatically
(torch_npu/npu/_npugraph_handlers/, §5.4). npu-ops.md names them but not how they are driven, so
they are not relied on: the explicit update runs either way, and their presence is only logged.

Below: what a captured decode graph keeps, the capture of each layer's decode attention as a task
group (NpuOps routes its decode paths here while a graph is being captured, `NpuOps._capturing`),
the update that re-issues those tasks with each replay's host lengths, and the backend that drives
them. Nothing here has run on an NPU; tests/fakes/fake_torch_npu.py emulates the graph APIs as the
note documents them."""
import importlib.util
import logging
from dataclasses import dataclass

import torch

from vlinfer.ops.interface import GraphModeUnavailable
from vlinfer.ops.npu.host import bsh_decode_args, paged_kv

logger = logging.getLogger("vlinfer")


# ---- graph mode: what a captured decode graph keeps ----

@dataclass
class AttentionTask:
    """One layer's captured attention: re-issued at every replay with the same tensors and that
    step's lengths."""
    handle: object  # graph_task_group_end's handle of the task group holding the FIA call
    # torch.npu.ExternalEvent the captured task waits on, recorded once the update is issued
    event: object
    args: tuple  # query, key, value as the call takes them: the graph's static memory
    kwargs: dict  # keyword arguments; actual_seq_lengths_kv is the capture's kv_lens list
    workspace: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


class GraphCapture:
    """The attention tasks of one decode graph (one batch size). While it is active
    (NpuOps._capturing), attention and the cache write take the step's lengths from here instead of
    reading them from device tensors: a .tolist() inside a capture is a device->host sync the graph
    cannot hold.

    kv_lens is the host list the tasks were captured with; update_graph_attention rewrites it in
    place and re-issues every task with it, so an object still referring to the list also sees the
    current lengths."""

    def __init__(self, kv_lens: list[int]):
        # Decode only: one query token per row, padded rows included, so the cumulative TND offsets
        # end at the padded T, as FIA requires (§2.3 "Sequence lengths", §5.4).
        self.q_ends = list(range(1, len(kv_lens) + 1))
        self.kv_lens = list(kv_lens)
        self.tasks: list[AttentionTask] = []


def missing_graph_features(torch_npu) -> list[str]:
    """The graph APIs the ACL graph backend needs that this torch_npu lacks (empty: all present)."""
    fia = torch_npu.npu_fused_infer_attention_score
    needs = {"torch_npu._npu_fused_infer_attention_score_get_max_workspace":
             hasattr(torch_npu, "_npu_fused_infer_attention_score_get_max_workspace"),
             "torch_npu.npu_fused_infer_attention_score.out": hasattr(fia, "out")}
    for name in ("NPUGraph", "graph", "Stream", "ExternalEvent", "graph_task_group_begin",
                 "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end"):
        needs[f"torch.npu.{name}"] = hasattr(torch.npu, name)
    return [name for name, present in needs.items() if not present]


# ---- capture: one layer's decode attention as an updatable task group ----

def _decode_call(ops, q, k_cache, v_cache, block_table, q_ends, kv_lens, antiquant=None):
    """FIA's (query, key, value), keywords and output buffer for a decode-only batch: the eager
    call's layout, TND (one call per layer) or BSH (the split path's decode call, every row a
    decode; an int8 cache's)."""
    if ops.features["tnd_paged"] and antiquant is None:
        k, v = paged_kv(k_cache, v_cache)
        return (q, k, v), dict(atten_mask=ops._causal_mask(q.device), actual_seq_lengths=q_ends,
                               actual_seq_lengths_kv=kv_lens, block_table=block_table,
                               num_heads=q.shape[1], num_key_value_heads=k_cache.shape[2],
                               input_layout="TND", sparse_mode=3,
                               block_size=k_cache.shape[1]), torch.empty_like(q)
    args, kwargs = bsh_decode_args(q, k_cache, v_cache, block_table, kv_lens, antiquant)
    return args, kwargs, torch.empty_like(args[0])


def captured_decode_attention(ops, q, k_cache, v_cache, block_tables, scale, antiquant=None):
    """Capture one layer's decode attention as its own task group (§5.1, §5.4): FIA's tiling comes
    from the host lengths, which the graph would otherwise replay as captured. The .out form writes
    a preallocated output with a workspace sized for any lengths (_get_max_workspace), so a re-issue
    at replay reuses the same memory. Before the group, the task waits on an ExternalEvent that the
    replay's update records, then resets it for the next replay."""
    cap, torch_npu = ops._capture, ops._torch_npu
    if q.shape[0] != len(cap.kv_lens):
        raise RuntimeError(f"a captured decode graph has one token per row: {q.shape[0]} tokens, "
                           f"{len(cap.kv_lens)} rows")
    block_table = block_tables if block_tables.dtype == torch.int32 else block_tables.to(
        torch.int32)
    args, kwargs, out = _decode_call(ops, q, k_cache, v_cache, block_table.contiguous(), cap.q_ends,
                                     cap.kv_lens, antiquant)
    kwargs[ops.features.get("fia_scale_kwarg") or "scale"] = scale
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(*args, **kwargs)
    # softmax_lse without the flag: a [1] zero (§2.3)
    lse = torch.empty(1, dtype=torch.float32, device=q.device)
    stream = torch.npu.current_stream()
    event = torch.npu.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    torch.npu.graph_task_group_begin(stream)
    torch_npu.npu_fused_infer_attention_score.out(*args, workspace=workspace, out=[out, lse],
                                                  **kwargs)
    handle = torch.npu.graph_task_group_end(stream)
    cap.tasks.append(AttentionTask(handle, event, args, kwargs, workspace, out, lse))
    return out.view(q.shape)


# ---- replay: the update ----

def update_graph_attention(torch_npu, capture: GraphCapture, kv_lens: list[int], stream) -> None:
    """Before a replay: re-issue every captured attention task with this step's kv lengths, on
    `stream` (the update stream) between graph_task_update_begin/end, and record each task's event
    so the replay's task runs after its update (§5.4). The query offsets stay: a graph's batch size
    is fixed."""
    if len(kv_lens) != len(capture.kv_lens):
        raise ValueError(f"{len(kv_lens)} lengths for a graph of {len(capture.kv_lens)} rows")
    capture.kv_lens[:] = kv_lens
    fia_out = torch_npu.npu_fused_infer_attention_score.out
    with torch.npu.stream(stream):
        for task in capture.tasks:
            torch.npu.graph_task_update_begin(stream, task.handle)
            fia_out(*task.args, workspace=task.workspace, out=[task.out, task.lse], **task.kwargs)
            torch.npu.graph_task_update_end(stream)
            task.event.record(stream)


# ---- the backend the graph runner drives ----

class AclGraphBackend:
    name = "ACL graphs (torch.npu.NPUGraph, attention re-issued with each step's lengths)"
    # capture(fn, seq_lens) and replay(seq_lens) take the rows' KV lengths as a host list
    host_lengths = True
    pads_to_dummy_block = True

    def __init__(self, device: torch.device, ops):
        self.device, self.ops = device, ops
        # one memory pool shared by every bucket's graph (they never replay at once)
        self.pool = None
        self.update_stream = torch.npu.Stream(device=device)

    def reads_only_used_blocks(self, block_size: int, dtype: torch.dtype) -> bool:
        # FIA reads only the first ceil(len / block_size) entries of a block-table row (§1): the
        # captured width costs no memory, so graphs serve contexts up to max_model_len.
        return True

    def capture(self, fn, seq_lens: list[int]):
        torch.npu.synchronize()
        graph = torch.npu.NPUGraph()
        capture = GraphCapture(seq_lens)
        with self.ops._capturing(capture), torch.npu.graph(graph, pool=self.pool):
            output = fn()
        if self.pool is None:
            self.pool = graph.pool()
        torch.npu.synchronize()
        if not capture.tasks:
            raise RuntimeError("no attention task was captured")
        return AclGraph(graph, output, capture, self.ops, self.update_stream)


class AclGraph:
    def __init__(self, graph, output: torch.Tensor, capture: GraphCapture, ops, update_stream):
        self.graph, self.output, self.capture = graph, output, capture
        self.ops, self.update_stream = ops, update_stream

    def replay(self, seq_lens: list[int]) -> torch.Tensor:
        # The updates rewrite tasks of this graph: let them start after everything queued before
        # (the previous replay of the same graph included).
        self.update_stream.wait_stream(torch.npu.current_stream())
        self.ops._update_graph_attention(self.capture, seq_lens, self.update_stream)
        self.graph.replay()
        return self.output  # the static output: read it before the next replay


def backend(device: torch.device, ops) -> AclGraphBackend:
    """The ACL graph backend over the engine's NpuOps, or GraphModeUnavailable (logged by the graph
    runner, which runs eager)."""
    missing = missing_graph_features(ops._torch_npu)
    if missing:
        raise GraphModeUnavailable(f"this torch_npu lacks {', '.join(missing)}")
    try:
        handlers = importlib.util.find_spec("torch_npu.npu._npugraph_handlers") is not None
    except (ImportError, ValueError, AttributeError):
        handlers = False
    if handlers:
        logger.info(
            "graph mode: torch_npu ships _npugraph_handlers; attention tasks are still updated "
            "explicitly "
            "each replay (npu-ops.md §5.4 does not document how the handlers are driven)")
    return AclGraphBackend(device, ops)
