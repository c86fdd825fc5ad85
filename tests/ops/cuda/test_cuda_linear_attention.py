"""Our Triton kernels for the hybrid models' linear attention (vlinfer/ops/cuda/linear_attention.py,
cuda/triton/linear_attention.py) through CudaOps against the reference op
(ops/reference/linear_attention.py), the oracle, per sequence (tests/support/paged_batches.py). On
CPU tensors the kernels run under the Triton interpreter, the same branch a GPU compiles; with a GPU
(bench/cuda_check.sh) they run compiled on it.

Each call packs sequences of different lengths in scrambled slots of a pool whose other slots
must stay bit-identical: a decode batch (one token each, some from zeros, a padded row of slot -1
that writes nothing) and a prefill batch with initial states (lengths on both sides of the
reference's 64-token block, one-token sequences among them). Value heads grouped over key heads,
head dims that are not powers of two, value columns over two program blocks, conv channels over two.
Tolerances: outputs float32 2e-5, bf16 2e-2 (the attention kernels' values: the oracle in float32
on the same bf16 inputs); the float32 state 2e-5; the conv state exact (it copies inputs).
A decode step reads no tensor value back to the host (what a CUDA graph needs); the reference
trips the same guard. The decode batch runs the recurrent kernel, the prefill batch the chunked
one (blocks of 16 tokens: the 70-token sequence ends in a partial block). Negative controls
planted in the kernel source itself: the decay's sign flipped (in each kernel), the chunked
form's forward substitution skipped, the recurrent state's write skipped (in each), the conv
state's write skipped; each fails the same check.

The engine: a tiny Qwen3.5 (tests/models/test_qwen3_5_text.py's checkpoint) on the CUDA op table,
its greedy tokens and logprobs equal to the reference table's, the kernels' launches counted (decode
and prefill) so a dispatch that fell back to the reference fails. Chunked prefill in the slow tier.
"""
import importlib.util
import sys

import pytest
import torch

from paged_batches import CUDA_ATTENTION_TOL as TOL, rel_err_per_seq
from qwen3_5_text_cases import PROMPTS, checkpoint, make_llm  # noqa: F401  (the tiny Qwen3.5)
from vlinfer import SamplingParams
from vlinfer.ops.cuda import CudaOps
from vlinfer.ops.cuda import linear_attention as cuda_la
from vlinfer.ops.cuda.loader import KERNEL_DIR
from vlinfer.ops.reference import linear_attention as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter
STATE_TOL = 2e-5
SLOTS = 10
# (key heads, value heads, key dim, value dim): two column blocks of 32 in the second
SHAPES = [(2, 4, 24, 16), (1, 2, 16, 40)]
CONV = [(80, 4), (24, 3)]  # (channels, kernel width): two channel blocks of 64 in the first
# (lengths, slots, has_state): a decode batch with a padded row; a prefill batch, initial states
BATCHES = [([1, 1, 1, 1, 1], [7, 2, -1, 0, 5], [True, False, True, True, True]),
           ([9, 1, 70, 3], [4, 8, 1, 6], [True, True, False, True])]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def interpreted(mp):
    import triton  # noqa: F401  (a test dependency: a missing one fails here)
    if DEVICE == "cpu":
        mp.setenv("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. at load
    mp.setitem(sys.modules, "flash_attn", None)


@pytest.fixture(scope="module")
def ops():
    with pytest.MonkeyPatch.context() as mp:
        interpreted(mp)
        ops = CudaOps(DEVICE)
        assert ops._linear_attention_kernels() is not None, "the kernels failed their check"
        assert ops.features["linear_attention"] == "triton"
    return ops


def packed(lengths):
    return torch.tensor([0] + lengths).cumsum(0).to(DEVICE)


def delta_inputs(shape, batch, dtype, seed=0):
    key_heads, value_heads, dk, dv = shape
    lengths, slots, has = batch
    tokens = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, key_heads, dk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(tokens, value_heads, dv, generator=g).to(dtype)
    decay = -torch.rand(tokens, value_heads, generator=g) * 0.5  # log-decays, e^g in (0.6, 1]
    beta = torch.rand(tokens, value_heads, generator=g)
    state = torch.randn(SLOTS, value_heads, dk, dv, generator=g)
    return ([t.to(DEVICE) for t in (q, k, v, decay, beta, state)]
            + [packed(lengths), torch.tensor(slots, device=DEVICE),
               torch.tensor(has, device=DEVICE)])


def check_delta_rule(run, shape, batch, dtype, seed=0):
    """run(q, k, v, g, beta, state, cu, slots, has, scale) against the reference on float32 copies
    of the same inputs: outputs per sequence, every live slot's state, the others untouched."""
    q, k, v, decay, beta, state, cu, slots, has = delta_inputs(shape, batch, dtype, seed)
    scale = shape[2] ** -0.5
    ours_state = state.clone()
    ours = run(q, k, v, decay, beta, ours_state, cu, slots, has, scale)
    assert ours.dtype == dtype and ours.shape == v.shape
    live = slots >= 0
    expected_state = state.clone()
    expected = torch.zeros(v.shape)
    rows = torch.repeat_interleave(live.cpu(), torch.tensor(batch[0]))
    cu_live = packed([n for n, s in zip(batch[0], batch[1]) if s >= 0]).cpu()
    expected[rows] = reference.gated_delta_rule(
        q[rows].float(), k[rows].float(), v[rows].float(), decay[rows], beta[rows],
        expected_state, cu_live.to(DEVICE), slots[live], has[live], scale).cpu()
    assert (ours[~rows].float() == 0).all()  # a padded row gives zeros
    assert rel_err_per_seq(ours[rows].cpu(), expected[rows], cu_live) < TOL[dtype]
    touched = slots[live].cpu()
    assert rel_err_per_seq(ours_state.cpu()[touched], expected_state.cpu()[touched]) < STATE_TOL
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(ours_state[untouched.to(DEVICE)], state[untouched.to(DEVICE)])


def conv_inputs(conv, batch, dtype, seed=0):
    channels, width = conv
    lengths, slots, has = batch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), channels, generator=g).to(dtype)
    weight = (torch.randn(channels, width, generator=g) / 2).to(dtype)
    bias = torch.randn(channels, generator=g).to(dtype)
    conv_state = torch.randn(SLOTS, channels, width - 1, generator=g).to(dtype)
    return ([t.to(DEVICE) for t in (x, weight, bias, conv_state)]
            + [packed(lengths), torch.tensor(slots, device=DEVICE),
               torch.tensor(has, device=DEVICE)])


def check_conv(run, conv, batch, dtype, seed=0):
    x, weight, bias, conv_state, cu, slots, has = conv_inputs(conv, batch, dtype, seed)
    ours_state = conv_state.clone()
    ours = run(x, weight, bias, ours_state, cu, slots, has)
    assert ours.dtype == dtype and ours.shape == x.shape
    live = slots >= 0
    rows = torch.repeat_interleave(live.cpu(), torch.tensor(batch[0]))
    cu_live = packed([n for n, s in zip(batch[0], batch[1]) if s >= 0]).cpu()
    expected_state = conv_state.float()
    expected = torch.zeros(x.shape)
    expected[rows] = reference.causal_conv1d(
        x[rows].float(), weight.float(), bias.float(), expected_state, cu_live.to(DEVICE),
        slots[live], has[live]).cpu()
    assert (ours[~rows].float() == 0).all()
    assert rel_err_per_seq(ours[rows].cpu(), expected[rows], cu_live) < TOL[dtype]
    # every slot: the live ones hold the reference's inputs, the others untouched (bit for bit)
    assert torch.equal(ours_state.float(), expected_state)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("batch", BATCHES, ids=["decode", "prefill"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gated_delta_rule_equals_reference(ops, shape, batch, dtype):
    check_delta_rule(ops.gated_delta_rule, shape, batch, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("batch", BATCHES, ids=["decode", "prefill"])
@pytest.mark.parametrize("conv", CONV, ids=str)
def test_causal_conv1d_equals_reference(ops, conv, batch, dtype):
    check_conv(ops.causal_conv1d, conv, batch, dtype)


def test_calls_take_the_kernels(ops, monkeypatch):
    """The op table's calls reach the kernels (a dispatch to the reference would pass the checks
    above too); a bf16 recurrent state runs the reference, by the rule."""
    module = ops._linear_attention_kernels()
    calls = []
    for name in ("causal_conv1d", "gated_delta_rule"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name:
                            calls.append(name) or real(*a))
    check_delta_rule(ops.gated_delta_rule, SHAPES[0], BATCHES[0], torch.float32)
    check_conv(ops.causal_conv1d, CONV[0], BATCHES[0], torch.float32)
    assert calls == ["gated_delta_rule", "causal_conv1d"]
    q, k, v, _, _, state, *_ = delta_inputs(SHAPES[0], BATCHES[0], torch.float32)
    assert not cuda_la.kernel_takes_delta_rule(q, k, v, state.bfloat16())


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")


@pytest.mark.parametrize("op", ["gated_delta_rule", "causal_conv1d"])
def test_a_decode_step_reads_nothing_back_to_the_host(ops, op, monkeypatch):
    """What a CUDA graph needs of a decode step: no tensor value read on the host (slots,
    cu_seqlens and has_state stay on the device). The guard is real: the reference, which loops
    over cu_seqlens on the host, trips it."""
    ops._linear_attention_kernels()  # loaded (and checked) before the guard goes on
    if op == "gated_delta_rule":
        args = delta_inputs(SHAPES[0], BATCHES[0], torch.float32) + [0.5]
    else:
        args = conv_inputs(CONV[0], BATCHES[0], torch.float32)

    def host_read(*a, **k):
        raise AssertionError("a tensor read on the host")
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, host_read)
    getattr(ops, op)(*args)
    with pytest.raises(AssertionError, match="on the host"):
        getattr(reference, op)(*args)


# ---- negative controls: a bug planted in the kernel source fails the same check ----

# (source text, its replacement, the batch that must catch it: decode runs the recurrent kernel,
# prefill the chunked one)
PLANTS = {
    "decay sign, recurrent": ("s = s * tl.exp(g)", "s = s * tl.exp(-g)", "decode"),
    "decay sign, chunked": ("g[None, :], 0.0), 1)", "-g[None, :], 0.0), 1)", "prefill"),
    "substitution skipped": ("for i in range(1, BT):", "for i in range(1, 1):", "prefill"),
    "state write skipped, recurrent": ("    tl.store(s_ptrs, s, mask=smask)\n", "\n", "decode"),
    "state write skipped, chunked": ("    tl.store(s_ptrs, s, mask=smask)\n", "\n", "prefill"),
    "conv state write skipped": ("    tl.store(state_row[:, None] + taps[None, :]",
                                 "    if False:\n"
                                 "        tl.store(state_row[:, None] + taps[None, :]", "prefill"),
}


def planted(tmp_path, edit):
    """The kernels' module with one edit to its source, loaded under the interpreter (on CPU)."""
    with open(f"{KERNEL_DIR}/linear_attention.py") as f:
        source = f.read()
    old, new = edit
    assert old in source, old
    path = tmp_path / "planted_linear_attention.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location("_vlinfer_triton_planted", path)
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        interpreted(mp)
        spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_bug_fails_the_check(tmp_path, plant):
    old, new, batch = PLANTS[plant]
    module = planted(tmp_path, (old, new))
    batch = BATCHES[0] if batch == "decode" else BATCHES[1]
    with pytest.raises(AssertionError):
        if plant.startswith("conv"):
            check_conv(module.causal_conv1d, CONV[1], batch, torch.float32)
        else:
            check_delta_rule(module.gated_delta_rule, SHAPES[0], batch, torch.float32)


# ---- the engine: a tiny Qwen3.5 on the CUDA op table equals the reference table ----

ENGINE_PROMPTS = [p for p in PROMPTS if len(p) < 64]  # kept short: every step is interpreted


def count_kernel_calls(monkeypatch, ops) -> list:
    """(kernel name, a decode call: one token per sequence) per call of the engine's kernels."""
    module = ops._linear_attention_kernels()
    assert module is not None and ops.features["linear_attention"] == "triton"
    calls = []
    for name, cu_arg in (("causal_conv1d", 4), ("gated_delta_rule", 6)):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, cu_arg=cu_arg: (
            calls.append((name, a[0].shape[0] == a[cu_arg].shape[0] - 1)) or real(*a)))
    return calls


def engine_run(folder, ops_name, monkeypatch, **kw):
    """(greedy tokens, their logprobs, the kernel calls counted on the CUDA table)."""
    llm = make_llm(folder, ops=ops_name, device=DEVICE, enforce_eager=True, **kw)
    calls = []
    if ops_name == "cuda":
        calls = count_kernel_calls(monkeypatch, llm.engine.model_runner.ctx.ops)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    outs = llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)
    logprobs = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]
    return [o.outputs[0].token_ids for o in outs], torch.tensor(logprobs), calls


def assert_engine_equals_reference(folder, monkeypatch, **kw) -> list:
    expected, expected_logprobs, _ = engine_run(folder, "reference", monkeypatch, **kw)
    interpreted(monkeypatch)
    tokens, logprobs, calls = engine_run(folder, "cuda", monkeypatch, **kw)
    assert tokens == expected
    assert (logprobs - expected_logprobs).abs().max().item() < 1e-4
    return calls


def test_qwen3_5_engine_on_the_kernels_equals_the_reference(checkpoint, monkeypatch):  # noqa: F811
    """Prompts of 5, 37 and 1 tokens, four greedy tokens each, float32: prefill and decode
    steps both on the kernels (counted, so a fallback to the reference fails here)."""
    calls = assert_engine_equals_reference(checkpoint[1], monkeypatch)
    assert set(calls) == {(n, d) for n in ("causal_conv1d", "gated_delta_rule")
                          for d in (True, False)}


@pytest.mark.slow  # 16-token steps: many more interpreted calls
def test_qwen3_5_chunked_prefill_on_the_kernels(checkpoint, monkeypatch):  # noqa: F811
    """The state carried across prefill chunks by the kernels: the reference table's tokens."""
    calls = assert_engine_equals_reference(checkpoint[1], monkeypatch, max_num_batched_tokens=16)
    assert ("gated_delta_rule", False) in calls
