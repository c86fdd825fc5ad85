"""Graph mode on the NPU (vlinfer/ops/npu/graph.py, the "graph mode" section of
vlinfer/ops/npu/backend.py and vlinfer/ops/npu/graph.py) on CPU tensors, through the ACL graph
emulation of tests/fakes/fake_torch_npu.py: a replay re-executes what the capture recorded, and a
torch_npu task keeps its captured host arguments (FIA's lengths) unless it was re-issued through
graph_task_update_begin/end. So graphs whose attention is not updated give wrong outputs here, as on
the device.

The engine runs on CPU tensors with the NPU ops (VLINFER_OPS=npu); the "cpu" device type gets the
NPU graph backend, as tests/engine/test_graph_runner.py does with its replaying backend. bfloat16
throughout: FIA takes fp16/bf16."""
import logging
import types

import pytest
import torch

from engine_checks import assert_block_pool_empty
from fake_torch_npu import FakeNpuError, loaded
from paged_batches import rel_err_per_seq
from graph_runner_cases import (
    PROMPTS,
    TEXT_PROMPT,
    VL_PROMPT,
    EchoModel,
    generate,
    picture,
    step,  # noqa: F401
    vl_checkpoint)
from vlinfer import LLM
from vlinfer.config import EngineConfig
from vlinfer.engine import graph_runner
from vlinfer.layers import ModelContext
from vlinfer.ops import ReferenceOps, reference
from vlinfer.ops.npu import NpuOps
from vlinfer.ops.npu import graph as npu_graph
from vlinfer.ops.npu.graph import GraphCapture

BLOCK = 128
KW = dict(dtype="bfloat16", kvcache_block_size=BLOCK, max_num_seqs=6, kv_cache_bytes=8 * 2**20,
          max_model_len=512)


@pytest.fixture
def npu_graphs(monkeypatch):
    """The emulated torch_npu with its graph APIs, and the NPU graph backend for the engine's (CPU)
    device."""
    fake, _ = loaded(monkeypatch)
    monkeypatch.setattr(NpuOps, "graph_capture", lambda ops, device: npu_graph.backend(device, ops))
    return fake


# ---- the captured attention task, alone ----

def attention_inputs(kv_lens, num_heads=4, num_kv_heads=2, head_dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(kv_lens)
    num_blocks = 2 * b + 1
    k_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).bfloat16()
    tables = torch.randperm(num_blocks, generator=g)[:2 * b].view(b, 2).int()
    q = torch.randn(b, num_heads, head_dim, generator=g).bfloat16()
    return q, k_cache, v_cache, torch.arange(b + 1, dtype=torch.int32), tables


def expected(q, k_cache, v_cache, cu, tables, kv_lens):
    return reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu,
                                     torch.tensor(kv_lens, dtype=torch.int32), tables, 0.125)


def close(a, b):
    """Within the bf16 attention tolerance, each decode row (a sequence) at its own scale."""
    return rel_err_per_seq(a, b) < 1e-2


@pytest.mark.parametrize("tnd", [True, False], ids=["tnd", "bsh"])
def test_replay_keeps_captured_lengths_unless_updated(monkeypatch, tnd):
    fake, ops = loaded(monkeypatch, tnd_paged=tnd)
    captured, now = [3, 200, 1], [150, 7, 256]
    q, k_cache, v_cache, cu, tables = attention_inputs(captured)
    seq_lens = torch.tensor(captured, dtype=torch.int32)
    graph, capture = torch.npu.NPUGraph(), GraphCapture(captured)
    with ops._capturing(capture), torch.npu.graph(graph):
        out = ops.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.125)
    assert ops._capture is None  # capturing ends with its block
    assert len(capture.tasks) == 1
    assert fake.last["npu_fused_infer_attention_score.out"]["input_layout"] == ("TND"
                                                                                if tnd else "BSH")

    # New queries in the static buffer, new lengths for the step.
    q.copy_(attention_inputs(captured, seed=1)[0])
    # no update issued: the replay would hang
    with pytest.raises(FakeNpuError, match="never recorded"):
        graph.replay()
    # The events recorded but the task not re-issued: FIA replays with the lengths it was captured
    # with.
    for task in capture.tasks:
        task.event.record()
    graph.replay()
    assert close(out, expected(q, k_cache, v_cache, cu, tables, captured))
    assert not close(out, expected(q, k_cache, v_cache, cu, tables, now))
    # Re-issued on the update stream with the step's lengths: the replay attends over them.
    stream = torch.npu.Stream()
    ops._update_graph_attention(capture, now, stream)
    graph.replay()
    assert close(out, expected(q, k_cache, v_cache, cu, tables, now))
    # negative control: the longest row's last key dropped is not close
    assert not close(out, expected(q, k_cache, v_cache, cu, tables, [150, 7, 255]))
    assert fake.graph.updates == {"npu_fused_infer_attention_score.out": 1}
    assert fake.graph.replayed["npu_fused_infer_attention_score.out"] == 2

    # What the update mechanism refuses: the default stream, and tensors other than the captured
    # ones.
    with pytest.raises(FakeNpuError, match="update stream"):
        ops._update_graph_attention(capture, now, torch.npu.current_stream())
    task = capture.tasks[0]
    task.args = (task.args[0].clone(),) + task.args[1:]
    with pytest.raises(FakeNpuError, match="captured tensors"):
        ops._update_graph_attention(capture, now, stream)


def test_capture_refuses_host_syncs(monkeypatch):
    _, ops = loaded(monkeypatch)
    q, k_cache, v_cache, cu, tables = attention_inputs([5, 9])
    seq_lens = torch.tensor([5, 9], dtype=torch.int32)
    # The eager attention reads its lengths with .tolist(): not inside a capture.
    with pytest.raises(FakeNpuError, match="tolist"), torch.npu.graph(torch.npu.NPUGraph()):
        ops.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.125)
    with pytest.raises(FakeNpuError, match="host value"), torch.npu.graph(torch.npu.NPUGraph()):
        seq_lens.max().item()
    with pytest.raises(FakeNpuError, match="data-dependent"), torch.npu.graph(torch.npu.NPUGraph()):
        q[seq_lens > 6]
    # The eager cache write drops -1 slots after checking for them on the host; captured, it takes
    # them as given.
    with pytest.raises(FakeNpuError, match="host value"), torch.npu.graph(torch.npu.NPUGraph()):
        ops.store_kvcache(q[:, :2], q[:, :2], k_cache, v_cache, torch.tensor([3, -1]))
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # restored after each capture


def test_backend_needs_the_graph_apis_and_the_npu_ops(monkeypatch, caplog):
    npu_device = types.SimpleNamespace(type="npu")
    _, ops = loaded(monkeypatch, graphs=False)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        assert graph_runner.select_backend(EngineConfig(model="m"), npu_device, ops) is None
    assert "graphs unavailable on npu (this torch_npu lacks " \
           "torch_npu._npu_fused_infer_attention_score_get_max_workspace, " \
           "torch_npu.npu_fused_infer_attention_score.out, torch.npu.NPUGraph" in caplog.text
    _, ops = loaded(monkeypatch)
    backend = graph_runner.select_backend(EngineConfig(model="m"), npu_device, ops)
    assert backend.name.startswith("ACL graphs") and backend.ops is ops
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        assert graph_runner.select_backend(EngineConfig(model="m"), npu_device,
                                           ReferenceOps("npu")) is None
    assert ("graphs unavailable on npu (the reference ops read sequence lengths on the host)"
            in caplog.text)


class HostLengthsBackend:
    """Like the ACL graph backend towards the graph runner: host lengths in, padding into a dummy
    block."""
    name = "host lengths (test)"
    host_lengths = True
    pads_to_dummy_block = True

    def __init__(self):
        self.lengths = []

    def capture(self, fn, seq_lens):
        self.lengths.append(("capture", seq_lens))

        def replay(lens):
            self.lengths.append(("replay", lens))
            return fn()
        return types.SimpleNamespace(replay=replay)


def test_padding_into_the_dummy_block_with_host_lengths():
    backend = HostLengthsBackend()
    assert graph_runner.dummy_blocks(backend, 8, 4) == 2 and graph_runner.dummy_blocks(
        backend, 300, 128) == 2
    assert graph_runner.dummy_blocks(None, 8, 4) == 0
    ctx = ModelContext(ReferenceOps())
    runner = graph_runner.GraphRunner(EchoModel(ctx), ctx, torch.device("cpu"), backend,
                                      [1, 2, 4, 8], 4, False, dummy_block=10, block_size=4)
    runner.capture()
    # Captured on all-padding buffers: each row its own dummy slot, one token of the dummy block to
    # attend to.
    assert backend.lengths == [("capture", [1] * size) for size in (8, 4, 2, 1)]
    assert runner.slot_mapping.tolist() == list(range(40,
                                                      48)) and runner.seq_lens.tolist() == [1] * 8
    out = runner.run(step(5, 2))
    assert backend.lengths[-1] == ("replay", [40, 41, 42, 43, 44, 1, 1, 1])
    assert out[:, 2].tolist() == [30, 31, 32, 33, 34] and out[:, 3].tolist() == [40, 41, 42, 43, 44]
    assert runner.slot_mapping[5:].tolist() == [45, 46, 47
                                                ] and runner.seq_lens[5:].tolist() == [1, 1, 1]
    assert runner.block_tables[5:, 0].tolist() == [10] * 3 and (runner.block_tables[5:, 1:]
                                                                == -1).all()
    assert (runner.block_tables[:5, 2:] == -1).all()


# ---- the engine: graph mode vs eager ----

@pytest.fixture(scope="module")
def text_expected(qwen3_checkpoint):
    """Greedy outputs of the eager engine on the emulated NPU (own monkeypatch: module scope)."""
    with pytest.MonkeyPatch.context() as mp:
        loaded(mp)
        eager = LLM(qwen3_checkpoint[0], enforce_eager=True, **KW)
        return generate(eager, PROMPTS)


def test_text_graph_mode_equals_eager(npu_graphs, qwen3_checkpoint, text_expected, caplog):
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(qwen3_checkpoint[0], **KW)
    assert "graph mode: ACL graphs (torch.npu.NPUGraph, attention re-issued with each step's " \
           "lengths) for decode at batch sizes [1, 2, 4, 6]" in caplog.text
    runner = llm.engine.model_runner
    graphs = runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 6]
    assert type(runner.ctx.ops) is NpuOps and runner.graph_backend.ops is runner.ctx.ops
    assert graph_runner.blocks_for(runner.graph_backend, 100_000, BLOCK,
                                   torch.bfloat16) == -(-100_000 // BLOCK)
    # One reserved block past the block manager's: the padded rows' slots.
    bm = llm.engine.block_manager
    pool = runner.cache_pool
    assert pool.kv_cache.shape[2] == bm.num_blocks + 1 and pool.dummy_block == bm.num_blocks
    assert graphs.pad_slots.tolist() == [bm.num_blocks * BLOCK + i for i in range(6)]

    assert generate(llm, PROMPTS) == text_expected
    replays = sum(graphs.replays.values())
    assert replays >= 15 and graphs.replays[6] and graphs.replays[4]  # batches 5 and 3 padded
    layers = len(runner.cache_pool.layers)
    # Every replay re-issued every layer's attention task, and replayed it.
    assert npu_graphs.graph.updates["npu_fused_infer_attention_score.out"] == layers * replays
    assert npu_graphs.graph.replayed["npu_fused_infer_attention_score.out"] == layers * replays
    assert sum(g.replays for g in (graphs.graphs[s].graph for s in graphs.sizes)) == replays
    assert_block_pool_empty(llm)


def test_text_graph_mode_without_length_updates_goes_wrong(npu_graphs, qwen3_checkpoint,
                                                           text_expected, monkeypatch):
    """The checks above would miss a backend that does not update the attention tasks: they must
    fail with one."""
    def events_only(self, capture, kv_lens, stream):  # orders the replay, never re-issues the tasks
        for task in capture.tasks:
            task.event.record(stream)
    monkeypatch.setattr(NpuOps, "_update_graph_attention", events_only)
    llm = LLM(qwen3_checkpoint[0], **KW)
    assert llm.engine.model_runner.graphs is not None
    assert generate(llm, PROMPTS) != text_expected
    assert not npu_graphs.graph.updates

    monkeypatch.setattr(NpuOps, "_update_graph_attention",
                        lambda self, capture, kv_lens, stream: None)
    llm = LLM(qwen3_checkpoint[0], **KW)
    with pytest.raises(FakeNpuError, match="never recorded"):
        generate(llm, PROMPTS)


def test_float32_cannot_be_captured_and_runs_eager(npu_graphs, qwen3_checkpoint, caplog):
    # FIA and the cache writes take fp16/bf16 only: float32 runs them on the reference, which reads
    # host lengths.
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        llm = LLM(qwen3_checkpoint[0], **{**KW, "dtype": "float32"})
    assert llm.engine.model_runner.graphs is None
    assert "graph mode: capture failed (RuntimeError: store_kvcache on torch.float32 runs the " \
           "pure-torch reference" in caplog.text


def test_qwen3_vl_graph_mode_equals_eager(npu_graphs, vl_checkpoint, monkeypatch):  # noqa: F811
    requests = [{"prompt": VL_PROMPT, "multi_modal_data": {"image": [picture(96, 128, 1)]}},
                TEXT_PROMPT,
                {"prompt": VL_PROMPT, "multi_modal_data": {"image": [picture(128, 200, 4)]}},
                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]
    kw = {**KW, "kv_cache_bytes": 16 * 2 ** 20, "max_num_batched_tokens": 128}
    expected = generate(LLM(vl_checkpoint, enforce_eager=True, **kw), requests)
    llm = LLM(vl_checkpoint, **kw)
    graphs = llm.engine.model_runner.graphs
    assert graphs is not None and graphs.positions.shape == (3, 6)  # MRoPE positions [3, T]
    assert generate(llm, requests) == expected
    assert sum(graphs.replays.values()) >= 8
    assert npu_graphs.graph.updates["npu_fused_infer_attention_score.out"] > 0
    assert_block_pool_empty(llm)
