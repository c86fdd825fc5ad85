"""Our CPU kernels for the hybrid models' linear attention (ops/cpu/linear_attention.py,
csrc/linear_attention.cpp for decode, csrc/linear_attention_prefill.cpp for prefill and mixed
calls) against transformers' Qwen3.5 functions, the oracle, per sequence, at each kernel level
(tests/support/cpu_levels.py: this CPU's level by default, the others in the slow tier).

Decode: `torch_recurrent_gated_delta_rule` and `causal_conv1d_update`. A decode batch: sequences
in scrambled slots of a pool whose unused slots hold garbage that must stay bit-identical, some
starting from zeros (has_state False), value heads grouped over key heads, head dims 64, 128 and
ones that are not powers of two (the vector strips' scalar tails). float32 within 1e-5 relative
per sequence; bf16 q/k/v/x within 1e-2 (the output's bf16 rounding; the oracle gets the same bf16
inputs in float32), the float32 state within 1e-5 in both. Negative controls: a state read from
the neighbouring slot holding the same sequence one step stale, and one head's decay skipped where
the decay is above 0.999, must each fail the same per-sequence check.

Prefill: `torch_chunk_gated_delta_rule` (the recurrence for one-token sequences of a mixed call)
and `causal_conv1d_fn` / `causal_conv1d_update` over packed sequences of lengths on both sides of
the 64-token block and not multiples of it, key / value dims 48 / 80 and 128, value heads grouped
over key heads; the same tolerances. Negative controls planted in the kernel itself (its `plant`
argument): a block one token longer than the loop's step, and each decay applied one token late,
where every decay is above 0.99, must each fail the same per-sequence check."""
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from cpu_levels import kernel_levels
from paged_batches import rel_err, rel_err_per_seq
from vlinfer.ops.cpu import CpuOps
from vlinfer.ops.cpu import backend as cpu_backend
from vlinfer.ops.cpu import linear_attention as cpu_la
from vlinfer.ops.reference import linear_attention as reference
from vlinfer.ops.select import select
from vlinfer.platform import cpu_features

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # outputs; the float32 state: 1e-5 always
STATE_TOL = 1e-5
# (key heads, value heads, key dim, value dim)
SHAPES = [(2, 4, 64, 64), (1, 2, 128, 128), (2, 2, 24, 40), (1, 3, 96, 24), (2, 6, 40, 96)]
HAS_STATE = [True, False, True, True, False]
SLOTS = [6, 2, 0, 7, 4]  # scrambled; slots 1, 3, 5 and 8 unused
POOL = 9


@pytest.fixture(scope="module", params=kernel_levels())
def cpu(request):
    ops = CpuOps(isa=request.param)
    assert ops.isa == request.param
    return ops


def _decode_inputs(hk, hv, dk, dv, dtype, seed, decay_scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    b = len(SLOTS)
    q = torch.randn(b, hk, dk, generator=gen).to(dtype)
    k = torch.randn(b, hk, dk, generator=gen).to(dtype)
    v = torch.randn(b, hv, dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(b, hv, generator=gen)) * decay_scale  # log-decays <= 0
    beta = torch.rand(b, hv, generator=gen).to(dtype)
    pool = torch.randn(POOL, hv, dk, dv, generator=gen) * 0.3  # garbage where unused
    return q, k, v, g, beta, pool


def _cu(batch):
    return torch.arange(batch + 1, dtype=torch.int32)


def _oracle(q, k, v, g, beta, pool, slots):
    """transformers' recurrence per sequence on float32 copies: (o [B, Hv, Dv], final states)."""
    outs, finals = [], []
    for i, slot in enumerate(slots):
        init = pool[slot][None].clone() if HAS_STATE[i] else None
        o, s = hf.torch_recurrent_gated_delta_rule(
            q[None, i:i + 1].float(), k[None, i:i + 1].float(), v[None, i:i + 1].float(),
            g=g[None, i:i + 1], beta=beta[None, i:i + 1].float(), initial_state=init,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        finals.append(s[0])
    return torch.cat(outs), finals


def _delta_rule(ops, q, k, v, g, beta, pool, slots):
    """ops' gated_delta_rule on a copy of the pool: (o, the pool after)."""
    after = pool.clone()
    o = ops.gated_delta_rule(q, k, v, g, beta, after, _cu(len(slots)), torch.tensor(slots),
                             torch.tensor(HAS_STATE), q.shape[-1] ** -0.5)
    return o, after


def _delta_rule_error(o, after, want, want_states, slots, cu=None):
    """The worst per-sequence error of the outputs and of the final states."""
    out_err = rel_err_per_seq(o, want, _cu(len(slots)) if cu is None else cu)
    state_err = max(rel_err(after[slot], s) for slot, s in zip(slots, want_states))
    return out_err, state_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_delta_rule_decode_matches_transformers(cpu, dtype, shape):
    q, k, v, g, beta, pool = _decode_inputs(*shape, dtype, seed=sum(shape))
    want, want_states = _oracle(q, k, v, g, beta, pool, SLOTS)
    assert cpu_la.kernel_takes_delta_rule(q, k, v, pool)
    o, after = _delta_rule(cpu, q, k, v, g, beta, pool, SLOTS)
    assert o.dtype == dtype and o.shape == v.shape
    out_err, state_err = _delta_rule_error(o, after, want, want_states, SLOTS)
    assert out_err < TOL[dtype] and state_err < STATE_TOL
    unused = [s for s in range(POOL) if s not in SLOTS]
    assert torch.equal(after[unused], pool[unused]), "a slot no sequence owns was written"


def test_delta_rule_decode_reads_strided_views(cpu):
    """q, k, v as the layer gets them: views into one [B, 2 Dk Hk + Dv Hv] conv output."""
    hk, hv, dk, dv = 2, 4, 64, 40
    q, k, v, g, beta, pool = _decode_inputs(hk, hv, dk, dv, torch.float32, seed=11)
    mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qs, ks, vs = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=1)
    views = [t.view(len(SLOTS), -1, d) for t, d in ((qs, dk), (ks, dk), (vs, dv))]
    assert not views[0].is_contiguous()
    want, want_states = _oracle(q, k, v, g, beta, pool, SLOTS)
    o, after = _delta_rule(cpu, *views, g, beta, pool, SLOTS)
    out_err, state_err = _delta_rule_error(o, after, want, want_states, SLOTS)
    assert out_err < TOL[torch.float32] and state_err < STATE_TOL


def test_delta_rule_negative_controls_fail(cpu):
    """Two planted bugs, each a small error in one sequence, fail the check above: the neighbouring
    slot read instead of a sequence's own, where the neighbour holds that sequence's state one
    token stale (what an off-by-one in the slot index would read); and the decay skipped for one
    value head of one sequence whose decay is above 0.999 (under a 0.1% change)."""
    hk, hv, dk, dv = 1, 2, 64, 40
    q, k, v, g, beta, pool = _decode_inputs(hk, hv, dk, dv, torch.float32, seed=5,
                                            decay_scale=0.002)
    want, want_states = _oracle(q, k, v, g, beta, pool, SLOTS)
    o, after = _delta_rule(cpu, q, k, v, g, beta, pool, SLOTS)
    assert max(_delta_rule_error(o, after, want, want_states, SLOTS)) < TOL[torch.float32]

    # sequence 2 owns slot 0; its neighbour, slot 1, holds its state from one token before (the
    # oracle's step from there on a previous token gives slot 0's)
    stale = pool.clone()
    prev = _decode_inputs(hk, hv, dk, dv, torch.float32, seed=6, decay_scale=0.002)
    _, newer = hf.torch_recurrent_gated_delta_rule(
        *(t[None, 2:3] for t in prev[:3]), g=prev[3][None, 2:3], beta=prev[4][None, 2:3],
        initial_state=pool[0][None].clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    stale[0], stale[1] = newer[0], pool[0]
    want_s, _ = _oracle(q, k, v, g, beta, stale, SLOTS)
    off_by_one = [1 if s == 0 else s for s in SLOTS]
    o, after = _delta_rule(cpu, q, k, v, g, beta, stale, off_by_one)
    assert rel_err_per_seq(o, want_s, _cu(len(SLOTS))) > 10 * TOL[torch.float32]

    # decay skipped for (sequence 0, value head 1): g = 0 there
    assert -0.001 < g[0, 1] < 0
    skipped = g.clone()
    skipped[0, 1] = 0.0
    o, after = _delta_rule(cpu, q, k, v, skipped, beta, pool, SLOTS)
    out_err, state_err = _delta_rule_error(o, after, want, want_states, SLOTS)
    assert out_err > 10 * TOL[torch.float32] and state_err > 10 * STATE_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels, width, with_bias", [(40, 4, False), (1000, 4, True),
                                                        (7, 2, True)])
def test_conv_decode_matches_transformers(cpu, dtype, channels, width, with_bias):
    gen = torch.Generator().manual_seed(channels)
    b = len(SLOTS)
    x = torch.randn(b, channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    pool = torch.randn(POOL, channels, width - 1, generator=gen).to(dtype)
    after = pool.clone()
    assert cpu_la.kernel_takes_conv(x, weight, after)
    got = cpu.causal_conv1d(x, weight, bias, after, _cu(b), torch.tensor(SLOTS),
                            torch.tensor(HAS_STATE))
    for i, slot in enumerate(SLOTS):
        state = pool[slot][None].clone() if HAS_STATE[i] else torch.zeros_like(pool[slot][None])
        want = hf.causal_conv1d_update(x[i][None, :, None], state, weight, bias,
                                       activation="silu")[0, :, 0]
        assert rel_err(got[i], want) < TOL[dtype]
        assert torch.equal(after[slot], state[0])
    unused = [s for s in range(POOL) if s not in SLOTS]
    assert torch.equal(after[unused], pool[unused])


# Prefill and mixed calls: (lengths, has_state, key heads, value heads, key dim, value dim)
PREFILL_CASES = [
    ([130, 1, 70, 5], [True, True, False, True], 2, 4, 48, 80),  # a mixed call, grouped heads
    ([64, 200], [False, True], 1, 2, 128, 128),
    ([2, 129, 1], [True, False, False], 1, 3, 40, 24),
]
PLANT_OVERLAP, PLANT_LATE_DECAY = 1, 2  # csrc/linear_attention_prefill.cpp's planted bugs


def _prefill_inputs(lengths, hk, hv, dk, dv, dtype, seed, decay_scale=0.5):
    """(q, k, v, g, beta, cu_seqlens, the pool, slots): sequence i in slot POOL - 1 - 2 i (spare
    slots between, holding garbage)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, hk, dk, generator=gen).to(dtype)
    k = torch.randn(t, hk, dk, generator=gen).to(dtype)
    v = torch.randn(t, hv, dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(t, hv, generator=gen)) * decay_scale
    beta = torch.rand(t, hv, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    pool = torch.randn(POOL, hv, dk, dv, generator=gen) * 0.3
    slots = [POOL - 1 - 2 * i for i in range(len(lengths))]
    return q, k, v, g, beta, cu, pool, slots


def _prefill_oracle(q, k, v, g, beta, cu, pool, slots, has_state):
    """transformers per sequence on float32 copies: the chunked form, the recurrence for one
    token. (o [T, Hv, Dv], final states)."""
    outs, finals = [], []
    for i, slot in enumerate(slots):
        a, b = int(cu[i]), int(cu[i + 1])
        init = pool[slot][None].clone() if has_state[i] else None
        fn = hf.torch_recurrent_gated_delta_rule if b - a == 1 else hf.torch_chunk_gated_delta_rule
        o, s = fn(q[None, a:b].float(), k[None, a:b].float(), v[None, a:b].float(),
                  g=g[None, a:b], beta=beta[None, a:b].float(), initial_state=init,
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        finals.append(s[0])
    return torch.cat(outs), finals


def _prefill_kernel(cpu, q, k, v, g, beta, cu, pool, slots, has_state, plant):
    """The prefill kernel itself, a bug planted or not, on a copy of the pool: (o, the pool)."""
    after = pool.clone()
    o = cpu.ext.gated_delta_rule_prefill(q, k, v, g, beta, after, cu, torch.tensor(slots),
                                         torch.tensor(has_state), q.shape[-1] ** -0.5,
                                         reference.CHUNK, plant)
    return o, after


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_delta_rule_prefill_matches_transformers(cpu, monkeypatch, dtype, case):
    """Through the op table: the call takes the prefill kernel (the reference would raise)."""
    lengths, has_state, *shape = PREFILL_CASES[case]
    q, k, v, g, beta, cu, pool, slots = _prefill_inputs(lengths, *shape, dtype, seed=case)
    want, want_states = _prefill_oracle(q, k, v, g, beta, cu, pool, slots, has_state)
    monkeypatch.setattr(cpu_la.reference, "gated_delta_rule", None)
    after = pool.clone()
    o = cpu.gated_delta_rule(q, k, v, g, beta, after, cu, torch.tensor(slots),
                             torch.tensor(has_state), shape[2] ** -0.5)
    assert o.dtype == dtype and o.shape == v.shape
    out_err, state_err = _delta_rule_error(o, after, want, want_states, slots, cu)
    assert out_err < TOL[dtype] and state_err < STATE_TOL
    unused = [s for s in range(POOL) if s not in slots]
    assert torch.equal(after[unused], pool[unused]), "a slot no sequence owns was written"


def test_delta_rule_prefill_reads_strided_views(cpu):
    """q, k, v as the layer gets them: views into one [T, 2 Dk Hk + Dv Hv] conv output."""
    lengths, has_state, hk, hv, dk, dv = [70, 3], [True, False], 2, 4, 48, 40
    q, k, v, g, beta, cu, pool, slots = _prefill_inputs(lengths, hk, hv, dk, dv, torch.float32,
                                                        seed=7)
    mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qs, ks, vs = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=1)
    views = [t.view(sum(lengths), -1, d) for t, d in ((qs, dk), (ks, dk), (vs, dv))]
    assert not views[0].is_contiguous()
    want, want_states = _prefill_oracle(q, k, v, g, beta, cu, pool, slots, has_state)
    o, after = _prefill_kernel(cpu, *views, g, beta, cu, pool, slots, has_state, 0)
    assert max(_delta_rule_error(o, after, want, want_states, slots, cu)) < TOL[torch.float32]


def test_delta_rule_prefill_negative_controls_fail(cpu):
    """Two bugs planted in the kernel, each failing the check above where the same call without
    it passes: a block one token longer than the loop's step (the token after each block enters
    the state twice), and each token's decay applied one token late, every decay above 0.99."""
    lengths, has_state = [150, 70, 1], [True, False, True]
    inputs = _prefill_inputs(lengths, 1, 2, 48, 40, torch.float32, seed=9, decay_scale=0.002)
    q, k, v, g, beta, cu, pool, slots = inputs
    assert g.exp().min() > 0.99
    want, want_states = _prefill_oracle(q, k, v, g, beta, cu, pool, slots, has_state)
    errors = {}
    for plant in (0, PLANT_OVERLAP, PLANT_LATE_DECAY):
        o, after = _prefill_kernel(cpu, *inputs, has_state, plant)
        errors[plant] = _delta_rule_error(o, after, want, want_states, slots, cu)
    assert max(errors[0]) < TOL[torch.float32]
    for plant in (PLANT_OVERLAP, PLANT_LATE_DECAY):
        assert min(errors[plant]) > 10 * TOL[torch.float32], (plant, errors[plant])


def test_prefill_with_empty_sequences_matches_the_reference(cpu):
    """A sequence of no tokens keeps its slot (has_state) or leaves it zeroed, as the reference."""
    lengths, has_state = [0, 66, 0], [True, True, False]
    q, k, v, g, beta, cu, pool, slots = _prefill_inputs(lengths, 1, 2, 16, 24, torch.float32,
                                                        seed=4)
    want_pool = pool.clone()
    want = reference.gated_delta_rule(q, k, v, g, beta, want_pool, cu, torch.tensor(slots),
                                      torch.tensor(has_state), 0.25)
    o, after = _prefill_kernel(cpu, q, k, v, g, beta, cu, pool, slots, has_state, 0)
    assert rel_err(o, want) < TOL[torch.float32]
    assert rel_err(after, want_pool) < TOL[torch.float32]
    assert torch.equal(after[slots[0]], pool[slots[0]]) and not after[slots[2]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels, width, with_bias", [(40, 4, False), (1000, 4, True),
                                                        (7, 2, True)])
def test_conv_prefill_matches_transformers(cpu, monkeypatch, dtype, channels, width, with_bias):
    """Packed sequences across the kernel's 64-token tiles, one shorter than the kept context
    (its window reaches into the slot's inputs), some from zeros: causal_conv1d_update from the
    slot's state, causal_conv1d_fn from zeros; the slot gets the last K - 1 inputs exactly."""
    lengths, has_state = [70, 1, 2, 130], [True, False, True, False]
    gen = torch.Generator().manual_seed(channels)
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    pool = torch.randn(POOL, channels, width - 1, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    slots = [POOL - 1 - 2 * i for i in range(len(lengths))]
    monkeypatch.setattr(cpu_la.reference, "causal_conv1d", None)
    after = pool.clone()
    got = cpu.causal_conv1d(x, weight, bias, after, cu, torch.tensor(slots),
                            torch.tensor(has_state))
    for i, slot in enumerate(slots):
        rows = x[int(cu[i]):int(cu[i + 1])].t()[None]  # [1, C, n]
        if has_state[i]:
            state = pool[slot][None].clone()
            want = hf.causal_conv1d_update(rows, state, weight, bias, activation="silu")[0].t()
        else:
            want = hf.causal_conv1d_fn(rows, weight, bias, activation="silu")[0].t()
            state = F.pad(rows[0], (width - 1, 0))[:, -(width - 1):][None]
        assert rel_err(got[int(cu[i]):int(cu[i + 1])], want) < TOL[dtype]
        assert torch.equal(after[slot], state[0])
    unused = [s for s in range(POOL) if s not in slots]
    assert torch.equal(after[unused], pool[unused])


def test_every_call_takes_a_kernel_unless_its_tensors_do_not_fit(cpu, monkeypatch):
    """The rule (ops/cpu/linear_attention.py): decode, prefill and mixed calls run the kernels; a
    dtype the kernels lack runs the reference, with the same results."""
    calls = []

    def recording(name, fn):
        def wrapped(*args):
            calls.append(name)
            return fn(*args)
        return wrapped

    monkeypatch.setattr(cpu_la.reference, "gated_delta_rule",
                        recording("reference", reference.gated_delta_rule))
    monkeypatch.setattr(cpu_la.reference, "causal_conv1d",
                        recording("reference", reference.causal_conv1d))
    hk, hv, dk, dv = 1, 2, 32, 32
    q, k, v, g, beta, pool = _decode_inputs(hk, hv, dk, dv, torch.float32, seed=3)
    x, w = torch.randn(len(SLOTS), 16), torch.randn(16, 4)
    four = slice(0, 4)
    for cu, n in ((_cu(len(SLOTS)), len(SLOTS)), (torch.tensor([0, 2, 3, 4, 5]), 4)):
        cpu.gated_delta_rule(q, k, v, g, beta, pool.clone(), cu.int(), torch.tensor(SLOTS[:n]),
                             torch.tensor(HAS_STATE[:n]), dk ** -0.5)
        cpu.causal_conv1d(x, w, None, torch.zeros(POOL, 16, 3), cu.int(),
                          torch.tensor(SLOTS[:n]), torch.tensor(HAS_STATE[:n]))
    assert calls == []
    half = [t.half() for t in (q, k, v)]
    assert not cpu_la.kernel_takes_delta_rule(*half, pool)
    assert not cpu_la.kernel_takes_delta_rule(q, k, v, pool.double())
    assert not cpu_la.kernel_takes_conv(x.half(), w, torch.zeros(POOL, 16, 3))
    prefill = torch.tensor([0, 2, 3, 4, 5], dtype=torch.int32)
    args = (torch.tensor(SLOTS[four]), torch.tensor(HAS_STATE[four]))
    ours, theirs = pool.clone(), pool.clone()
    got = cpu.gated_delta_rule(q, k, v, g, beta, ours, prefill, *args, dk ** -0.5)
    want = cpu.gated_delta_rule(q, k, v, g, beta, theirs.double(), prefill, *args, dk ** -0.5)
    assert calls == ["reference"] and rel_err(got, want) < TOL[torch.float32]


def test_prefill_refuses_bad_boundaries_and_shared_slots(cpu):
    q, k, v, g, beta, cu, pool, slots = _prefill_inputs([5, 70], 1, 1, 16, 16, torch.float32,
                                                        seed=1)
    has = torch.tensor([True, True])
    short = torch.tensor([0, 5, 74], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to the 75 tokens"):
        cpu.gated_delta_rule(q, k, v, g, beta, pool, short, torch.tensor(slots), has, 0.25)
    with pytest.raises(RuntimeError, match="given to two sequences"):
        cpu.gated_delta_rule(q, k, v, g, beta, pool, cu, torch.tensor([3, 3]), has, 0.25)
    x = torch.randn(75, 8)
    with pytest.raises(RuntimeError, match="cu_seqlens decreases at sequence 1"):
        cpu.causal_conv1d(x, torch.randn(8, 4), None, torch.zeros(POOL, 8, 3),
                          torch.tensor([0, 80, 75]), torch.tensor(slots), has)


def test_a_zero_length_sequence_is_refused_not_misread(cpu):
    """As many tokens as sequences but one sequence empty and another two long: the kernel refuses
    it (cu_seqlens not 0..B) rather than read the wrong rows."""
    q, k, v, g, beta, pool = _decode_inputs(1, 1, 16, 16, torch.float32, seed=1)
    cu = torch.tensor([0, 0, 2, 3, 4, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="one token per sequence"):
        cpu.gated_delta_rule(q, k, v, g, beta, pool, cu, torch.tensor(SLOTS),
                             torch.tensor(HAS_STATE), 0.25)


def test_duplicate_slots_are_refused(cpu):
    q, k, v, g, beta, pool = _decode_inputs(1, 1, 16, 16, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="given to two sequences"):
        cpu.gated_delta_rule(q, k, v, g, beta, pool, _cu(len(SLOTS)), torch.tensor([1] * 5),
                             torch.tensor(HAS_STATE), 0.25)


def test_kernels_are_logged_per_level(cpu, caplog):
    kernels = cpu.ext.linear_attention_kernels()
    want = {"generic": "the plain loops", "avx2": "AVX2"}.get(cpu.isa, "AVX-512")
    assert kernels == want
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        CpuOps(isa=cpu.isa)
    assert f"linear-attention kernels (decode and prefill): {want}" in caplog.text


@pytest.mark.slow  # the AVX2 build: one more build of the extension (tests/support/cpu_levels.py)
def test_an_avx2_cpu_runs_the_avx2_kernels(monkeypatch, caplog):
    """CPU flags mocked to an AVX2-only CPU: the op table builds that level and its decode calls
    run the AVX2 strips, its prefill calls the AVX2 tiles (and both still match transformers)."""
    monkeypatch.setattr(cpu_features, "cpu_flags",
                        lambda: frozenset({"sse2", "avx", "avx2", "fma", "f16c"}))
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ops = CpuOps()
    assert ops.isa == "avx2"
    assert "linear-attention kernels (decode and prefill): AVX2" in caplog.text
    q, k, v, g, beta, pool = _decode_inputs(2, 4, 24, 40, torch.float32, seed=4)
    want, want_states = _oracle(q, k, v, g, beta, pool, SLOTS)
    o, after = _delta_rule(ops, q, k, v, g, beta, pool, SLOTS)
    assert max(_delta_rule_error(o, after, want, want_states, SLOTS)) < TOL[torch.float32]
    lengths, has_state, *shape = PREFILL_CASES[0]
    q, k, v, g, beta, cu, pool, slots = _prefill_inputs(lengths, *shape, torch.float32, seed=4)
    want, want_states = _prefill_oracle(q, k, v, g, beta, cu, pool, slots, has_state)
    o, after = _prefill_kernel(ops, q, k, v, g, beta, cu, pool, slots, has_state, 0)
    assert max(_delta_rule_error(o, after, want, want_states, slots, cu)) < TOL[torch.float32]


def test_a_failed_build_logs_and_runs_the_reference(monkeypatch, caplog):
    """No compiler: the op table is the reference (logged), and a decode call still gives
    transformers' result."""
    def no_compiler(isa):
        raise RuntimeError("no c++ compiler")

    monkeypatch.setattr(cpu_backend, "build_extension", no_compiler)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        ops = select("cpu")
    assert ops.name != "cpu-compiled"
    assert "running the pure-torch reference" in caplog.text and "no c++ compiler" in caplog.text
    q, k, v, g, beta, pool = _decode_inputs(2, 4, 24, 40, torch.float32, seed=2)
    want, want_states = _oracle(q, k, v, g, beta, pool, SLOTS)
    o, after = _delta_rule(ops, q, k, v, g, beta, pool, SLOTS)
    assert max(_delta_rule_error(o, after, want, want_states, SLOTS)) < TOL[torch.float32]
