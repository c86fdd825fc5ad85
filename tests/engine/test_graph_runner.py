"""Graph mode's buckets, static buffers and padding (vlinfer/engine/graph_runner.py) on CPU, through
a backend whose "graph" records the captured callable and re-runs it on the static buffers at
replay: what a CUDA graph does, minus the capture. The engine's greedy outputs with it must equal
eager ones, for text and Qwen3-VL with images, with batches that are not bucket sizes and sequences
finishing mid-run.

torch.cuda.CUDAGraph itself needs a GPU and is not run here."""
import logging
import types

import pytest
import torch

from engine_checks import assert_block_pool_empty
from images import picture
from vlinfer import LLM
from vlinfer.config import EngineConfig
from vlinfer.engine import graph_runner
from vlinfer.layers import ModelContext
from vlinfer.ops import ReferenceOps
from graph_runner_cases import (MAX_TOKENS, PROMPTS, TEXT_PROMPT, TWO_IMAGES, VL_PROMPT, EchoModel,
                                ReplayBackend, cpu_graphs, generate, picture, step, vl_checkpoint)


def record_batches(monkeypatch):
    """(real batch, bucket) of every replay."""
    seen = []
    original = graph_runner.GraphRunner.run

    def run(self, inputs):
        b = inputs.input_ids.shape[0]
        seen.append((b, next(s for s in self.sizes if s >= b)))
        return original(self, inputs)
    monkeypatch.setattr(graph_runner.GraphRunner, "run", run)
    return seen


# ---- units ----

def test_batch_sizes():
    assert graph_runner.batch_sizes(1) == [1]
    assert graph_runner.batch_sizes(6) == [1, 2, 4, 6]
    assert graph_runner.batch_sizes(8) == [1, 2, 4, 8]
    assert graph_runner.batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_runner.batch_sizes(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # capped


@pytest.mark.parametrize(
    "device, kw, line",
    [
        ("cpu", {},
         "graph mode: none on cpu, running eager (torch.compile of the decode step measured slower"
         ),
        ("cpu", {"enforce_eager": True}, "graph mode: off (enforce_eager=True), running eager"),
        # npu: tests/ops/npu/test_npu_graph.py
        ("xpu", {}, "graph mode: not implemented for xpu yet, running eager"),
        ("cuda", {"tensor_parallel_size": 2
                  }, "graph mode: off under tensor parallelism (2 ranks), running eager"),
    ])
def test_select_backend_logs_the_mode(caplog, device, kw, line):
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        assert graph_runner.select_backend(EngineConfig(model="m", **kw),
                                           types.SimpleNamespace(type=device),
                                           ReferenceOps(device)) is None
    assert line in caplog.text


def test_cuda_backend_needs_the_cuda_ops(caplog):
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        assert graph_runner.select_backend(EngineConfig(model="m"), torch.device("cuda"),
                                           ReferenceOps("cuda")) is None
    assert ("graphs unavailable on cuda (the reference ops read sequence lengths on the host)"
            in caplog.text)


@pytest.mark.parametrize("mrope", [False, True])
def test_padding_and_static_buffers(mrope):
    ctx = ModelContext(ReferenceOps())
    runner = graph_runner.GraphRunner(EchoModel(ctx), ctx, torch.device("cpu"),
                                      ReplayBackend("cpu"), [1, 2, 4, 8], 4, mrope)
    runner.capture()
    # each forward's step cleared after it
    assert sorted(runner.graphs) == [1, 2, 4, 8] and ctx.step is None
    # A batch of 7 after a batch of 3: bucket 8, then bucket 4, whose rows 3.. held the first step's
    # values.
    for b in (7, 3):
        out = runner.run(step(b, 2, mrope))
        assert out.shape[0] == b
        assert out[:, 0].tolist() == list(range(10, 10 + b)) and out[:, 1].tolist() == list(
            range(20, 20 + b))
        assert out[:, 2].tolist() == list(range(30, 30 + b)) and out[:, 3].tolist() == list(
            range(40, 40 + b))
        assert out[:, 4].tolist() == [2 * i + 1 for i in range(b)]
        size = 8 if b == 7 else 4
        # padded rows write nothing
        assert runner.slot_mapping[b:size].tolist() == [-1] * (size - b)
        assert runner.seq_lens[b:size].tolist() == [0] * (size - b)  # ... and attend to nothing
        assert (runner.block_tables[b:size] == -1).all() and (runner.block_tables[:b, 2:]
                                                              == -1).all()
    assert runner.replays == {8: 1, 4: 1} and ctx.step is None
    # The step is the runner's context's: a model reading another engine's context sees no step.
    other = graph_runner.GraphRunner(EchoModel(ModelContext(ReferenceOps())), ctx,
                                     torch.device("cpu"), ReplayBackend("cpu"), [1, 2], 4, mrope)
    with pytest.raises(RuntimeError, match="outside a model runner step"):
        other.capture()
    # Eager: mixed steps, image rows, wider block tables than captured, batches above the largest
    # bucket.
    assert not runner.can_run(step(3, 2, mrope, decode_only=False))
    assert not runner.can_run(step(3, 2, mrope, mm={"mm_mask": torch.zeros(3, dtype=torch.bool)}))
    assert not runner.can_run(step(3, 5, mrope))
    assert not runner.can_run(step(9, 2, mrope))
    assert runner.can_run(step(8, 4, mrope))


# ---- the engine, graph mode vs eager ----


@pytest.fixture(params=["cpu-compiled", "cuda"])
def ops_mode(request, monkeypatch):
    """The CPU kernels, or the CUDA ops on CPU tensors (sync-free decode attention, the Triton cache
    write under the Triton interpreter) as graph mode uses them on a GPU."""
    import sys
    if request.param == "cuda":
        monkeypatch.setenv("VLINFER_OPS", "cuda")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setitem(sys.modules, "flash_attn", None)
    return request.param


def test_text_graph_mode_equals_eager(ops_mode, cpu_graphs, qwen3_checkpoint, monkeypatch, caplog):
    path = qwen3_checkpoint[0]
    # device="cpu": on a GPU machine "auto" would pick CUDA, and this test is about the CPU-tensor
    # emulation.
    eager = LLM(path, dtype="float32", max_num_seqs=6, kv_cache_bytes=4 * 2**20, enforce_eager=True,
                device="cpu")
    assert eager.engine.model_runner.graphs is None and not cpu_graphs
    # The CUDA ops' attention runs interpreted here (seconds a step): three prompts for them, five
    # on the CPU ops.
    prompts = PROMPTS if ops_mode == "cpu-compiled" else PROMPTS[:3]
    expected = generate(eager, prompts)
    seen = record_batches(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(path, dtype="float32", max_num_seqs=6, kv_cache_bytes=4 * 2 ** 20, device="cpu")
    assert llm.engine.ops_implementation == ops_mode
    ops = llm.engine.model_runner.ctx.ops
    if ops_mode == "cuda":
        assert ops.features == {
            "cache_write": "triton", "paged_attention": "triton", "attention": "triton"
        }
    assert "graph mode: eager replay (test) for decode at batch sizes [1, 2, 4, 6]" in caplog.text
    # the backend got this engine's op table
    assert len(cpu_graphs) == 1 and cpu_graphs[0].ops is ops
    assert ops is not eager.engine.model_runner.ctx.ops  # one per engine
    assert len(cpu_graphs[0].captured) == 4
    assert generate(llm, prompts) == expected
    assert (3, 4) in seen and ((5, 6) in seen or ops_mode == "cuda")  # padded replays
    assert sum(llm.engine.model_runner.graphs.replays.values()) == len(seen) >= max(
        MAX_TOKENS[:len(prompts)]) - 1
    assert_block_pool_empty(llm)
    # Again with the prompts sharing a cached prefix: prefill chunks after prefix hits stay eager,
    # decode replays. (On the CPU ops only: the CUDA ops' attention runs interpreted here, tens of
    # seconds a pass.)
    if ops_mode == "cpu-compiled":
        assert generate(llm, [p + [7] for p in PROMPTS]) == generate(eager,
                                                                     [p + [7] for p in PROMPTS])
        assert_block_pool_empty(llm)


def test_qwen3_vl_graph_mode_equals_eager(cpu_graphs, vl_checkpoint, monkeypatch):
    requests = [{"prompt": VL_PROMPT,
                 "multi_modal_data": {"image": [picture(96, 128, 1)]}}, TEXT_PROMPT, {
                     "prompt": TWO_IMAGES,
                     "multi_modal_data": {"image": [picture(64, 64, 2),
                                                    picture(160, 96, 3)]}
                 }, {"prompt": VL_PROMPT, "multi_modal_data": {"image": [picture(128, 200, 4)]}},
                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]
    kw = dict(dtype="float32", max_num_seqs=6, kv_cache_bytes=8 * 2 ** 20, max_model_len=512,
              # chunked prefill: image rows arrive over several eager steps
              max_num_batched_tokens=64)
    eager = LLM(vl_checkpoint, enforce_eager=True, **kw)
    expected = generate(eager, requests)
    seen = record_batches(monkeypatch)
    llm = LLM(vl_checkpoint, **kw)
    runner = llm.engine.model_runner
    # MRoPE positions [3, T]
    assert runner.graphs is not None and runner.graphs.positions.shape == (3, 6)
    assert generate(llm, requests) == expected
    # Prompts finish their chunked prefill at different steps, so decode-only batches are whatever
    # is left then.
    assert any(b < size for b, size in seen), "no padded replay"
    assert len({size for _, size in seen}) >= 2
    assert_block_pool_empty(llm)


def test_block_table_width_is_bounded_unless_attention_reads_only_used_blocks(monkeypatch):
    import sys
    from vlinfer.ops.cuda import CudaOps
    from vlinfer.ops.cuda.graph import CudaGraphBackend
    assert graph_runner.blocks_for(ReplayBackend("cpu"), 512, 16, torch.float32) == 32
    assert graph_runner.blocks_for(ReplayBackend("cpu"), 100_000, 16, torch.float32) == 8192 // 16
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    ops = CudaOps("cpu")
    backend = CudaGraphBackend(torch.device("cuda"), ops)
    # no flash_attn: SDPA
    assert graph_runner.blocks_for(backend, 100_000, 256, torch.bfloat16) == 8192 // 256
    ops._flash = object()  # flash_attn present: decode reads only each sequence's blocks
    assert graph_runner.blocks_for(backend, 100_000, 256, torch.bfloat16) == -(-100_000 // 256)
    # SDPA: block size
    assert graph_runner.blocks_for(backend, 100_000, 16, torch.bfloat16) == 8192 // 16
    # SDPA: dtype
    assert graph_runner.blocks_for(backend, 100_000, 256, torch.float32) == 8192 // 256
    # Another engine's op table without flash_attn bounds its own graphs, not this one's.
    other = CudaGraphBackend(torch.device("cuda"), CudaOps("cpu"))
    assert graph_runner.blocks_for(other, 100_000, 256, torch.bfloat16) == 8192 // 256
    assert graph_runner.blocks_for(backend, 100_000, 256, torch.bfloat16) == -(-100_000 // 256)
