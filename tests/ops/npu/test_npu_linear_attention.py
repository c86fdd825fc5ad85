"""Hybrid models' Gated DeltaNet on the NPU op table (vlinfer/ops/npu/linear_attention.py) on CPU
tensors, torch_npu's npu_recurrent_gated_delta_rule / npu_chunk_gated_delta_rule emulated by
tests/fakes/fake_torch_npu_gdn.py from their pages (docs/npu-ops.md §2.12, §2.13).

Two layers of checks, both against transformers' torch_recurrent_gated_delta_rule /
torch_chunk_gated_delta_rule (the oracle, independent of the fake and of our reference):
- the emulated calls as their pages define them (value-major states, one state index per token,
  num_accepted_tokens' starting state, the rejections the pages state);
- NpuOps.gated_delta_rule on them: decode calls, prefill chunks and mixed calls, slots reversed
  with spares between, some sequences starting from zeros, outputs per sequence and final states
  (read through the pool's logical [Hv, Dk, Dv] view) within BF16_BOUND of the float32 oracle.
  Negative controls: the caller's scale, gating or state layout wrong fails the same check.
bf16 throughout: the ops take bf16 only (§2.12); BF16_BOUND is the stated tolerance (bf16 inputs,
a bf16 state stored between calls)."""
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from fake_torch_npu import FakeNpuError, loaded
from paged_batches import rel_err, rel_err_per_seq
from vlinfer.ops.npu import linear_attention as npu_la

BF16_BOUND = 3e-2  # the stated bound (bf16 inputs and states); measured in npu-ops.md §2.12
# (sequence lengths, which continue from their slot, key heads, value heads, key dim, value dim)
DECODE = ([1, 1, 1, 1], [True, False, True, True], 2, 4, 32, 48)
PREFILL = ([5, 1, 70, 2], [False, True, True, False], 1, 2, 24, 40)
SQUARE = ([1, 1], [True, True], 2, 2, 32, 32)  # Dk == Dv: a transposed state is not a shape error


def inputs(lengths, hk, hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(t, hv, generator=gen)) * 0.4  # in [-1, 0] but for outliers
    g = g.clamp(min=-1.0)
    beta = torch.rand(t, hv, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return [x.bfloat16() for x in (q, k, v)] + [g, beta.bfloat16(), cu]


def oracle(q, k, v, g, beta, cu, states, has_state):
    """transformers' functions per sequence, float32: (o [T, Hv, Dv], final states [Hv, Dk, Dv])."""
    outs, finals = [], []
    for i in range(len(cu) - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        init = states[i][None].float() if has_state[i] else None
        fn = hf.torch_recurrent_gated_delta_rule if b - a == 1 else hf.torch_chunk_gated_delta_rule
        o, s = fn(*(x[None, a:b].float() for x in (q, k, v)), g=g[None, a:b],
                  beta=beta[None, a:b].float(), initial_state=init, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        finals.append(s[0])
    return torch.cat(outs), finals


def run(ops, case, seed=0):
    """NpuOps' gated_delta_rule on a value-major bf16 pool: (o, final states, the oracle's)."""
    lengths, has_state, hk, hv, dk, dv = case
    q, k, v, g, beta, cu = inputs(lengths, hk, hv, dk, dv, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    states = [(torch.randn(hv, dk, dv, generator=gen) * 0.1).bfloat16() for _ in lengths]
    slots = [len(lengths) + 1 - i for i in range(len(lengths))]  # reversed, spares between
    pool = ops.recurrent_state_pool((len(lengths) + 2, hv, dk, dv), torch.bfloat16, "cpu")
    pool.copy_(torch.randn(pool.shape, generator=gen))  # spare and fresh slots hold garbage
    for i, slot in enumerate(slots):
        pool[slot] = states[i]
    o = ops.gated_delta_rule(q, k, v, g, beta, pool, cu, torch.tensor(slots),
                             torch.tensor(has_state), dk**-0.5)
    want, want_states = oracle(q, k, v, g, beta, cu, states, has_state)
    return o, [pool[s] for s in slots], want, want_states, cu


def error(o, finals, want, want_states, cu):
    return max(rel_err_per_seq(o, want, cu), *(rel_err(a, b) for a, b in zip(finals, want_states)))


@pytest.mark.parametrize("case", [DECODE, PREFILL, SQUARE], ids=["decode", "prefill", "square"])
def test_gated_delta_rule_on_the_npu_ops_matches_transformers(monkeypatch, case):
    fake, ops = loaded(monkeypatch)
    assert error(*run(ops, case)) < BF16_BOUND
    op = npu_la.RECURRENT if len(case[0]) == sum(case[0]) else npu_la.CHUNK
    assert fake.calls[op] == 1 and fake.calls[npu_la.RECURRENT] + fake.calls[npu_la.CHUNK] == 1
    assert fake.last[op]["scale"] == case[4]**-0.5


def plant(fake, op, bug):
    """Wrap the emulated op so its caller looks as if it had `bug`."""
    real = getattr(fake, op)

    def buggy(q, k, v, *args, **kw):
        if bug == "scale":  # the query scale dropped
            kw["scale"] = 1.0
        elif bug == "gating":  # the decay passed as e^g, not as the log-decay g
            kw["g"] = kw["g"].exp()
        elif bug == "layout" and args:  # the pool handed over key-major
            args = (args[0].transpose(-1, -2).contiguous(),)
        elif bug == "layout":  # initial states gathered key-major
            kw["initial_state"] = kw["initial_state"].transpose(-1, -2).contiguous()
        return real(q, k, v, *args, **kw)
    setattr(fake, op, buggy)


@pytest.mark.parametrize("bug", ["scale", "gating", "layout"])
@pytest.mark.parametrize("case", [DECODE, PREFILL, SQUARE], ids=["decode", "prefill", "square"])
def test_a_wrong_caller_fails(monkeypatch, case, bug):
    fake, ops = loaded(monkeypatch)
    op = npu_la.RECURRENT if len(case[0]) == sum(case[0]) else npu_la.CHUNK
    plant(fake, op, bug)
    try:
        err = error(*run(ops, case))
    except FakeNpuError:  # the page's contract rejects the call (a shape, g's range)
        return
    assert err > 3 * BF16_BOUND, err


# ---- the emulated calls as their pages define them ----

def value_major(states):
    return torch.stack(states).transpose(-1, -2).contiguous().bfloat16()


def test_recurrent_op_as_documented_speculative(monkeypatch):
    """§2.12 with num_accepted_tokens: one state index per token; sequence i starts from the state
    of its token num_accepted_tokens[i] - 1 and writes each token's state at that token's index."""
    fake, _ = loaded(monkeypatch)
    lengths, accepted, hk, hv, dk, dv = [3, 2], [2, 1], 1, 2, 16, 24
    q, k, v, g, beta, cu = inputs(lengths, hk, hv, dk, dv, seed=4)
    qn, kn = (F.normalize(x.float(), dim=-1).bfloat16() for x in (q, k))
    gen = torch.Generator().manual_seed(9)
    states = [(torch.randn(hv, dk, dv, generator=gen) * 0.1).bfloat16() for _ in range(8)]
    pool = value_major(states)
    index = [6, 1, 3, 0, 5]  # per token
    out = fake.npu_recurrent_gated_delta_rule(
        qn, kn, v, pool, beta=beta, scale=0.3, actual_seq_lengths=torch.tensor(lengths).int(),
        ssm_state_indices=torch.tensor(index).int(), num_accepted_tokens=torch.tensor(
            accepted).int(), g=g)
    start = 0
    for n, a in zip(lengths, accepted):
        s = states[index[start + a - 1]].float()[None]
        for t in range(start, start + n):
            o, s = hf.torch_recurrent_gated_delta_rule(
                *(x[None, t:t + 1].float() for x in (q, k, v)), g=g[None, t:t + 1],
                beta=beta[None, t:t + 1].float(), initial_state=s, output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            o = o * (0.3 / dk**-0.5)  # transformers scales by Dk^-0.5; the op by `scale`
            assert rel_err(out[t], o[0, 0]) < BF16_BOUND
            assert rel_err(pool[index[t]].float().transpose(-1, -2), s[0]) < BF16_BOUND
        start += n
    untouched = [i for i in range(8) if i not in index]
    assert torch.equal(pool[untouched], value_major(states)[untouched])


def test_pages_rejections(monkeypatch):
    fake, _ = loaded(monkeypatch)
    q, k, v, g, beta, cu = inputs([3], 1, 2, 16, 24)
    qn, kn = (F.normalize(x.float(), dim=-1).bfloat16() for x in (q, k))
    init = torch.zeros(1, 2, 24, 16, dtype=torch.bfloat16)
    args = dict(beta=beta, initial_state=init, actual_seq_lengths=torch.tensor([3]).int(),
                scale=0.25, g=g)
    fake.npu_chunk_gated_delta_rule(qn, kn, v, **args)
    with pytest.raises(FakeNpuError, match="normalised"):
        fake.npu_chunk_gated_delta_rule(q, k, v, **args)
    with pytest.raises(FakeNpuError, match="value-major"):
        fake.npu_chunk_gated_delta_rule(qn, kn, v, **{**args, "initial_state": init.transpose(
            -1, -2).contiguous()})
    with pytest.raises(FakeNpuError, match=r"\[-1, 0\]"):
        fake.npu_chunk_gated_delta_rule(qn, kn, v, **{**args, "g": g - 1})
    with pytest.raises(FakeNpuError, match="scale"):
        fake.npu_chunk_gated_delta_rule(qn, kn, v, **{**args, "scale": None})
    with pytest.raises(FakeNpuError, match=r"1\.\.8"):  # the recurrent op: at most 8 per sequence
        fake.npu_recurrent_gated_delta_rule(
            *(torch.cat([x] * 3) for x in (qn, kn, v)), init.repeat(9, 1, 1, 1),
            beta=beta.repeat(3, 1), scale=0.25, actual_seq_lengths=torch.tensor([9]).int(),
            ssm_state_indices=torch.arange(9).int(), g=g.repeat(3, 1))


# ---- what runs the reference, logged ----

@pytest.mark.parametrize("why", ["float32", "missing", "decay"])
def test_reference_runs_logged(monkeypatch, caplog, why):
    fake, ops = loaded(monkeypatch, gdn=why != "missing")
    lengths, has_state, hk, hv, dk, dv = PREFILL
    q, k, v, g, beta, cu = inputs(lengths, hk, hv, dk, dv)
    dtype = torch.float32 if why == "float32" else torch.bfloat16
    if why == "float32":
        q, k, v, beta = (x.float() for x in (q, k, v, beta))
    if why == "decay":
        g = g * 3  # some below -1
    pool = ops.recurrent_state_pool((6, hv, dk, dv), dtype, "cpu")
    pool.copy_(torch.randn(pool.shape) * 0.1)
    initial = [pool[i].clone() for i in range(len(lengths))]
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        o = ops.gated_delta_rule(q, k, v, g, beta, pool, cu, torch.arange(len(lengths)),
                                 torch.tensor(has_state), dk**-0.5)
    want, _ = oracle(q, k, v, g, beta, cu, initial, has_state)
    assert rel_err_per_seq(o, want, cu) < (1e-5 if why == "float32" else BF16_BOUND)
    assert fake.calls[npu_la.CHUNK] == 0
    reason = {"float32": "bfloat16 activations and state only", "missing": "this torch_npu has no",
              "decay": "g >= -1"}[why]
    assert "gated_delta_rule (prefill)" in caplog.text and reason in caplog.text


def test_conv_runs_the_reference_logged(monkeypatch, caplog):
    _, ops = loaded(monkeypatch)
    x, weight = torch.randn(3, 8).bfloat16(), torch.randn(8, 4).bfloat16()
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        ops.causal_conv1d(x, weight, None, torch.zeros(2, 8, 3).bfloat16(),
                          torch.tensor([0, 3]).int(), torch.tensor([1]), torch.tensor([False]))
    assert "causal_conv1d on torch.bfloat16 runs the pure-torch reference" in caplog.text
    assert "npu_fused_causal_conv1d" in caplog.text


def test_capture_refuses_by_name(monkeypatch):
    """Hybrid decode stays eager on the NPU (the model runner says so); were it captured, both ops
    refuse with the reason instead of syncing inside the graph."""
    from vlinfer.ops.npu.graph import GraphCapture
    _, ops = loaded(monkeypatch)
    q, k, v, g, beta, cu = inputs([1], 1, 2, 16, 24)
    pool = ops.recurrent_state_pool((2, 2, 16, 24), torch.bfloat16, "cpu")
    with ops._capturing(GraphCapture([1])):
        with pytest.raises(RuntimeError, match="not ACL graph capture"):
            ops.gated_delta_rule(q, k, v, g, beta, pool, cu, torch.tensor([1]),
                                 torch.tensor([True]), 0.25)
        with pytest.raises(RuntimeError, match="cannot be captured"):
            ops.causal_conv1d(torch.randn(1, 8).bfloat16(), torch.randn(8, 4).bfloat16(), None,
                              torch.zeros(2, 8, 3).bfloat16(), cu, torch.tensor([1]),
                              torch.tensor([True]))
