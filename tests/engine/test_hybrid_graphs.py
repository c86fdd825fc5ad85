"""Decode graphs of hybrid models (engine/graph_runner.py's state slots) on the CUDA op table: a
tiny Qwen3.5 and Qwen3.5-MoE engine capturing its decode steps through vlinfer/ops/cuda/graph.py's
backend, replayed, equal to the same engine eager token for token and state for state after every
step.

Without a GPU the engine runs on CPU tensors with the CUDA ops (Triton kernels under the Triton
interpreter) and torch.cuda.CUDAGraph emulated by tests/fakes/fake_cuda_graph.py, which records
what a capture issues (aten ops on their tensors, Triton launches with their arguments) and replays
only that: a slot read on the host or built from host values at capture stays the captured one, and
a host read while capturing is refused as CUDA refuses it. With one (bench/cuda_check.sh runs this
file), the engine is on it, with the real torch.cuda.CUDAGraph and compiled kernels.

The schedule (max_num_seqs 4, buckets 1, 2, 4): three prompts decode together (a padded row in
bucket 4), the shortest finishes and a one-token prompt joins in its slot (has_state False in a
replayed step, a slot reused), a request hitting the first prompt's checkpointed prefix joins with
one token left to compute (its restore copied into its slot right before a replay), more finish and
the batches shrink through the buckets. Planted bugs fail the same check: padded rows writing slot
0, and the slot index baked into the graph from host values at capture; a host read of the slots
while capturing is refused by name."""
import logging
import sys

import pytest
import torch

from qwen3_5_text_cases import qwen3_5_moe_config, save, text_config
from vlinfer import LLM, SamplingParams
from vlinfer.engine import graph_runner
from vlinfer.ops import ReferenceOps
from vlinfer.ops.cuda import CudaOps
from vlinfer.ops.cuda import graph as cuda_graph
from vlinfer.toy.tiny_checkpoints import _rescale

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: interpreter and emulated graphs
EMULATED = DEVICE == "cpu"
BS = 16
FIRST = [(11 * i + 5) % 500 + 3 for i in range(20)]
# step -> requests joining before it: (id, prompt, max_tokens)
JOINS = {
    0: [("a", FIRST, 9), ("b", [(7 * i + 2) % 500 + 3 for i in range(5)], 12),
        ("c", [(5 * i + 1) % 500 + 3 for i in range(9)], 3)],
    4: [("d", [42], 4)],  # one token: its first step is a decode row from zeros
    6: [("e", FIRST[:BS] + [99], 5)],  # hits FIRST's first block: one token left to compute
}
MAX_STEPS = 40
# Per slot, relative to its largest entry. Not bit-exact (1.7e-5 seen by the fifth step on this
# CPU): the likely source is the padded bucket's matmuls (4 rows where eager has 3) rounding rows.
STATE_TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def checkpoint(request, tmp_path_factory):
    import transformers
    if request.param == "qwen3_5":
        config, cls = text_config(), transformers.Qwen3_5ForCausalLM
    else:
        config, cls = qwen3_5_moe_config(), transformers.Qwen3_5MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        model = cls(config).eval()
    _rescale(model, torch.Generator().manual_seed(6))
    return save(model, str(tmp_path_factory.mktemp(f"graphs-{request.param}")))


def cuda_ops_on_cpu(mp):
    """The CUDA op table (on CPU tensors without a GPU, its Triton kernels interpreted)."""
    mp.setenv("VLINFER_OPS", "cuda")
    if EMULATED:
        mp.setenv("TRITON_INTERPRET", "1")
    mp.setitem(sys.modules, "flash_attn", None)


@pytest.fixture(scope="module")
def eager(checkpoint):
    """The eager engine's trace (drive())."""
    with pytest.MonkeyPatch.context() as mp:
        cuda_ops_on_cpu(mp)
        llm = make_llm(checkpoint, enforce_eager=True)
        assert llm.engine.model_runner.graphs is None
        return drive(llm)


@pytest.fixture
def emulated(monkeypatch):
    """CUDA graphs on the engine's CPU device: the CUDA backend over the emulated CUDAGraph (the
    emulation's state; None on a GPU, which captures for real)."""
    import fake_cuda_graph
    cuda_ops_on_cpu(monkeypatch)
    if not EMULATED:
        return None
    state = fake_cuda_graph.install(monkeypatch)
    monkeypatch.setattr(CudaOps, "graph_capture",
                        lambda ops, device: cuda_graph.backend(device, ops))
    return state


def make_llm(folder, **kw):
    return LLM(folder, dtype="float32", device=DEVICE, kvcache_block_size=BS, max_num_seqs=4,
               max_model_len=128, kv_cache_bytes=4 * 2**20, **kw)


def drive(llm, expected: list[dict] | None = None) -> list[dict]:
    """Step the engine through JOINS; per step its new tokens by request, every state tensor (all
    slots, checkpoints included) and which slot each running request holds. With `expected`
    (another engine's trace), each step is checked against it as it is taken."""
    engine, trace = llm.engine, []
    for i in range(MAX_STEPS):
        for rid, prompt, n in JOINS.get(i, []):
            engine.add_request({"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                               request_id=rid)
        if not engine.has_unfinished_requests():
            break
        slots = {rid: seq.state_slot for rid, seq in engine.requests.items()}
        outs = engine.step()
        states = [t.clone() for ts in engine.model_runner.cache_pool.state_tensors for t in ts]
        trace.append(dict(tokens={o.request_id: list(o.outputs[0].token_ids) for o in outs},
                          states=states, slots=slots))
        if expected is not None:
            assert_same_step(trace[-1], expected[i], i)
    assert not engine.has_unfinished_requests()
    assert expected is None or len(trace) == len(expected)
    return trace


def assert_same_step(a: dict, b: dict, i: int) -> None:
    """The same tokens, and every state slot (per layer) within STATE_TOL of its own size."""
    assert a["tokens"] == b["tokens"], f"step {i}"
    for x, y in zip(a["states"], b["states"]):
        err = (x - y).flatten(2).abs().amax(-1) / y.flatten(2).abs().amax(-1).clamp_min(1e-30)
        assert err.max().item() < STATE_TOL, f"step {i}: a state off by {err.max().item():.3g}"


def record_replays(monkeypatch) -> list[tuple]:
    """(rows, bucket, has_state per row, restores before it) of every replay."""
    seen, run = [], graph_runner.GraphRunner.run

    def recording(self, inputs):
        b = inputs.input_ids.shape[0]
        seen.append((b, next(s for s in self.sizes if s >= b), inputs.has_state.tolist(),
                     list(inputs.state_restores)))
        return run(self, inputs)
    monkeypatch.setattr(graph_runner.GraphRunner, "run", recording)
    return seen


def test_replay_equals_eager(eager, checkpoint, emulated, monkeypatch, caplog):
    seen = record_replays(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = make_llm(checkpoint)
    assert "graph mode: CUDA graphs for decode at batch sizes [1, 2, 4]" in caplog.text
    assert "off for this hybrid model" not in caplog.text
    runner = llm.engine.model_runner
    assert runner.ctx.ops.features["linear_attention"] == "triton"
    assert sorted(runner.graphs.graphs) == [1, 2, 4]
    ours = drive(llm, eager)
    # what the replays covered
    assert not EMULATED or emulated.launches > 0  # the kernels ran from the recorded launches
    assert any(b < size for b, size, _, _ in seen), "no padded replay"
    assert {size for _, size, _, _ in seen} == {1, 2, 4}
    assert any(not all(has) for _, _, has, _ in seen), "no replayed row starting from zeros"
    assert any(restores for *_, restores in seen), "no prefix restore before a replay"
    holders = {}
    for step in ours:
        for rid, slot in step["slots"].items():
            holders.setdefault(slot, set()).add(rid)
    assert any(len(rids) > 1 for rids in holders.values()), "no slot reused"
    assert sum(runner.graphs.replays.values()) == len(seen)


# ---- planted bugs: each fails the same check (on the dense model: what they break is the
# runner's, not the model's) ----

DENSE = pytest.mark.parametrize("checkpoint", ["qwen3_5"], indirect=True)


@DENSE
def test_padding_writing_slot_0_fails(eager, checkpoint, emulated, monkeypatch):
    monkeypatch.setattr(graph_runner, "PAD_STATE_SLOT", 0)
    llm = make_llm(checkpoint)
    assert llm.engine.model_runner.graphs is not None
    with pytest.raises(AssertionError, match="step"):
        drive(llm, eager)


@DENSE
def test_slots_baked_at_capture_fail(eager, checkpoint, emulated, monkeypatch, caplog):
    """The runner keeping the step's slots as host ints and building the step's tensor from them
    inside the forward: captured with the padding's -1s, replayed with them (emulated; a GPU may
    refuse the host copy while capturing instead, and run eager, logged)."""
    forward, run = graph_runner.GraphRunner._forward, graph_runner.GraphRunner.run

    def baked_forward(self, size):
        static = self.states
        host = getattr(self, "host_slots", [graph_runner.PAD_STATE_SLOT] * self.sizes[-1])
        # a constant of the graph
        self.states = dict(static, slots=torch.tensor(host, device=static["slots"].device))
        try:
            return forward(self, size)
        finally:
            self.states = static

    def host_run(self, inputs):
        self.host_slots = inputs.state_slots.tolist() + [-1] * self.sizes[-1]
        return run(self, inputs)
    monkeypatch.setattr(graph_runner.GraphRunner, "_forward", baked_forward)
    monkeypatch.setattr(graph_runner.GraphRunner, "run", host_run)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        llm = make_llm(checkpoint)
    if llm.engine.model_runner.graphs is None:
        assert not EMULATED and "graph mode: capture failed" in caplog.text
        return
    with pytest.raises(AssertionError, match="step"):
        drive(llm, eager)


@DENSE
def test_slots_read_on_the_host_while_capturing_are_refused(checkpoint, emulated, monkeypatch,
                                                            caplog):
    if not EMULATED:
        pytest.skip("emulated capture only: a capture failed on a real GPU may leave its CUDA "
                    "context unusable for the tests after it")
    forward = graph_runner.GraphRunner._forward

    def reading_forward(self, size):
        static = self.states
        self.states = dict(static, slots=torch.tensor(static["slots"].tolist()))
        try:
            return forward(self, size)
        finally:
            self.states = static
    monkeypatch.setattr(graph_runner.GraphRunner, "_forward", reading_forward)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        llm = make_llm(checkpoint)
    assert llm.engine.model_runner.graphs is None
    assert "graph mode: capture failed (CaptureError: .tolist() while capturing" in caplog.text
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # restored when the capture ended


# ---- where hybrid decode stays eager, by name ----

@DENSE
def test_a_refusal_runs_eager_by_name(checkpoint, emulated, monkeypatch, caplog):
    """The op table's reason, logged by the model runner, and no capture; the CUDA table's own
    reason for a recurrent state its delta rule does not take (bf16: the reference runs it, and it
    reads lengths on the host)."""
    with monkeypatch.context() as mp, caplog.at_level(logging.INFO, logger="vlinfer"):
        mp.setattr(CudaOps, "state_graph_refusal", lambda ops, dtype: f"a reason ({dtype})")
        llm = make_llm(checkpoint)
    assert llm.engine.model_runner.graphs is None
    assert ("graph mode: off for this hybrid model (a reason (torch.float32)), running eager"
            in caplog.text)
    ops = CudaOps(DEVICE)
    assert ops.state_graph_refusal(torch.float32) is None
    assert ops.state_graph_refusal(torch.bfloat16) == (
        "the Triton delta rule takes a float32 recurrent state; a torch.bfloat16 one runs the "
        "reference, which reads lengths on the host")


def test_the_npu_keeps_hybrid_decode_eager(monkeypatch):
    from fake_torch_npu import loaded
    _, ops = loaded(monkeypatch)
    assert "not ACL graph capture" in ops.state_graph_refusal(torch.bfloat16)
    assert ReferenceOps().state_graph_refusal(torch.float32) == (
        "the reference linear-attention ops read lengths and slots on the host")
