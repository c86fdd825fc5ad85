"""LoRA steps in graph mode (vlinfer/engine/graph_runner.py: static LoRA buffers, the base model's
and padding rows in a slot kept zero): decode steps with adapters replay the captured graphs and
give the eager engine's tokens.

- ACL graphs under the emulated torch_npu (tests/fakes/fake_torch_npu.py), whose replay re-executes
  what
  the capture
  recorded with the captured tensors: the grouped matmuls of the LoRA op replay on the static
  buffers, so a replay
  that did not refill them (or a grouping that does not cover every row) gives other tokens or an
  error.
- CUDA graphs' code path with the CUDA ops on CPU tensors (the Triton LoRA kernels interpreted) and
  the test backend
  that re-runs the captured callable on the static buffers (tests/engine/test_graph_runner.py).

Three adapters over two slots: adapters swap in and out between replays. bfloat16 on the NPU (its
kernels' dtype), float32 on the CUDA path."""
import logging
import sys

import pytest
import torch

from engine_checks import assert_block_pool_empty
from fake_torch_npu import loaded
from graph_runner_cases import MAX_TOKENS, PROMPTS, cpu_graphs, greedy  # noqa: F401
from vlinfer import LLM, LoRARequest
from vlinfer.engine import graph_runner
from vlinfer.layers.lora import LoRAGroups
from vlinfer.ops.npu import NpuOps
from vlinfer.ops.npu import graph as npu_graph
from lora_cases import ALL_LINEARS, make_adapter

NPU_KW = dict(dtype="bfloat16", kvcache_block_size=128, max_num_seqs=6, kv_cache_bytes=8 * 2**20,
              max_model_len=512)
CUDA_KW = dict(dtype="float32", max_num_seqs=6, kv_cache_bytes=4 * 2 ** 20, device="cpu")
LORA_KW = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
# request i's adapter (index into the adapters), None: the base model
ADAPTER_OF = [None, 0, 1, 2, 0]


@pytest.fixture(scope="module")
def adapters(qwen3_checkpoint, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = qwen3_checkpoint[0]
    return [
        LoRARequest(
            name, i + 1,
            make_adapter(AutoModelForCausalLM.from_pretrained(path),
                         str(tmp_path_factory.mktemp(name)), rank, 2 * rank, False, ALL_LINEARS,
                         10 + i))
        for i, (name, rank) in enumerate((("eight", 8), ("four", 4), ("two", 2)))
    ]


def generate(llm, adapters, prompts=PROMPTS):
    loras = [None if a is None else adapters[a] for a in ADAPTER_OF]
    outs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS], use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def record_lora_replays(monkeypatch) -> list[tuple[int, int]]:
    """For every replay: (rows that ran an adapter, real rows)."""
    seen = []
    original = graph_runner.GraphRunner.run

    def run(self, inputs):
        adapter_rows = 0 if inputs.lora_slots is None else int((inputs.lora_slots >= 0).sum())
        seen.append((adapter_rows, inputs.input_ids.shape[0]))
        return original(self, inputs)
    monkeypatch.setattr(graph_runner.GraphRunner, "run", run)
    return seen


def check_graph_engine(llm, expected, adapters, seen):
    runner = llm.engine.model_runner
    graphs = runner.graphs
    assert graphs is not None and graphs.lora_slots == 3  # two slots and the zero one
    assert runner.lora.num_slots == 3 and all(layer.lora.a.shape[0] == 3
                                              for layer in runner.lora.layers.values())
    assert generate(llm, adapters) == expected
    # decode steps with adapters replayed
    assert sum(1 for rows, _ in seen if rows) >= max(MAX_TOKENS) - 2
    assert any(0 < rows < b for rows, b in seen)  # base and adapter rows in one replay
    assert any(b not in graphs.sizes for _, b in seen)  # padded replays
    zero = [layer.lora for layer in runner.lora.layers.values()]
    # the zero slot never got one
    assert all(not slots.a[2].any() and not slots.b[2].any() for slots in zero)
    assert_block_pool_empty(llm)


@pytest.fixture(scope="module")
def npu_expected(qwen3_checkpoint, adapters):
    with pytest.MonkeyPatch.context() as mp:
        loaded(mp)
        eager = LLM(qwen3_checkpoint[0], enforce_eager=True, **NPU_KW, **LORA_KW)
        expected = generate(eager, adapters)
        base = [
            o.outputs[0].token_ids
            for o in eager.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
        ]
    # every adapter changes its answer
    assert [e != b for e, b in zip(expected, base)][1:] == [True] * 4
    return expected


def test_npu_lora_steps_replay_acl_graphs(monkeypatch, qwen3_checkpoint, adapters, npu_expected,
                                          caplog):
    fake, _ = loaded(monkeypatch)
    monkeypatch.setattr(NpuOps, "graph_capture", lambda ops, device: npu_graph.backend(device, ops))
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(qwen3_checkpoint[0], **NPU_KW, **LORA_KW)
    assert "graph mode: ACL graphs" in caplog.text and "capture failed" not in caplog.text
    fake.graph.replayed.clear()
    seen = record_lora_replays(monkeypatch)
    check_graph_engine(llm, npu_expected, adapters, seen)
    # Two grouped matmuls (shrink, expand) per LoRA layer in every replay, run from the graph.
    layers = len(llm.engine.model_runner.lora.layers)
    assert fake.graph.replayed["npu_grouped_matmul"] == 2 * layers * len(seen) > 0


def test_npu_lora_replays_with_stale_groups_go_wrong(monkeypatch, qwen3_checkpoint, adapters,
                                                     npu_expected):
    """The check above would miss a runner that does not refill the LoRA buffers before a replay: it
    must fail."""
    loaded(monkeypatch)
    monkeypatch.setattr(NpuOps, "graph_capture", lambda ops, device: npu_graph.backend(device, ops))
    original = graph_runner.GraphRunner._fill_lora
    monkeypatch.setattr(graph_runner.GraphRunner, "_fill_lora",
                        # every row on the zero slot
                        lambda self, slots, size: original(self, None, size))
    llm = LLM(qwen3_checkpoint[0], **NPU_KW, **LORA_KW)
    assert llm.engine.model_runner.graphs is not None
    assert generate(llm, adapters) != npu_expected


@pytest.mark.slow  # the Triton LoRA and attention kernels interpreted: about 35 s
def test_cuda_lora_steps_replay_graphs(monkeypatch, cpu_graphs, qwen3_checkpoint,
                                       adapters):  # noqa: F811
    monkeypatch.setenv("VLINFER_OPS", "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    eager = LLM(qwen3_checkpoint[0], enforce_eager=True, **CUDA_KW, **LORA_KW)
    expected = generate(eager, adapters)
    seen = record_lora_replays(monkeypatch)
    llm = LLM(qwen3_checkpoint[0], **CUDA_KW, **LORA_KW)
    assert llm.engine.ops_implementation == "cuda" and len(cpu_graphs) == 1
    check_graph_engine(llm, expected, adapters, seen)


def test_host_grouped_ops_refuse_a_captured_step():
    """The CPU and reference ops group rows on the host: a captured step's groups (no host segments)
    are refused by name, so a graph backend over them fails its capture and the engine runs eager
    (logged)."""
    from vlinfer.ops import reference
    groups = LoRAGroups(torch.arange(2), torch.tensor([0, 0, 2]), None, torch.tensor([1, 1]), 2)
    x, a, b = torch.randn(2, 4), torch.zeros(2, 4, 4), torch.zeros(2, 4, 4)
    with pytest.raises(ValueError, match="captured graph step have no host segments"):
        reference.add_lora(x, torch.zeros(2, 4), a, b, groups)
