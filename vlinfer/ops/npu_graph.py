"""Graph mode on the NPU (ACL graphs, vlinfer/engine/acl_graph.py): what a captured decode graph keeps, and the
update that re-issues its attention tasks with each replay's host lengths (§5.4 of docs/npu-ops.md). NpuOps
(vlinfer/ops/npu.py, "graph mode") captures the tasks."""
from dataclasses import dataclass

import torch


# ---- graph mode: what a captured decode graph keeps ----

@dataclass
class AttentionTask:
    """One layer's captured attention: re-issued at every replay with the same tensors and that step's lengths."""
    handle: object  # graph_task_group_end's handle of the task group holding the FIA call
    event: object  # torch.npu.ExternalEvent the captured task waits on, recorded once the update is issued
    args: tuple  # query, key, value as the call takes them: the graph's static memory
    kwargs: dict  # keyword arguments; actual_seq_lengths_kv is the capture's kv_lens list
    workspace: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


class GraphCapture:
    """The attention tasks of one decode graph (one batch size). While it is active (NpuOps.capturing), attention
    and the cache write take the step's lengths from here instead of reading them from device tensors: a .tolist()
    inside a capture is a device->host sync the graph cannot hold.

    kv_lens is the host list the tasks were captured with; update_graph_attention rewrites it in place and re-issues
    every task with it, so an object still referring to the list also sees the current lengths."""

    def __init__(self, kv_lens: list[int]):
        # Decode only: one query token per row, padded rows included, so the cumulative TND offsets end at the padded
        # T, as FIA requires (§2.3 "Sequence lengths", §5.4).
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


def update_graph_attention(torch_npu, capture: GraphCapture, kv_lens: list[int], stream) -> None:
    """Before a replay: re-issue every captured attention task with this step's kv lengths, on `stream` (the update
    stream) between graph_task_update_begin/end, and record each task's event so the replay's task runs after its
    update (§5.4). The query offsets stay: a graph's batch size is fixed."""
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
