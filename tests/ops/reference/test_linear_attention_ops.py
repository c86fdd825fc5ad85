"""The linear-attention ops of hybrid models (vlinfer/ops/reference/linear_attention.py: causal
conv1d, the gated delta rule, the gated RMSNorm) against transformers' Qwen3.5 functions, the
oracle: `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` per sequence,
`causal_conv1d_fn` / `causal_conv1d_update` and `Qwen3_5RMSNormGated`.

Packed sequences of lengths 1..150 (across the 64-token chunk boundary), some continuing from a
state slot, value heads grouped over key heads, head dims that are and are not powers of two.
Errors per sequence (each sequence against its own scale) and per final state; float32 within
1e-5 relative. Negative controls: a state read from the wrong slot and a decay shifted by one
token must fail the same check."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from paged_batches import rel_err, rel_err_per_seq
from vlinfer.ops.reference import ReferenceOps
from vlinfer.ops.reference import linear_attention as la

TOL = 1e-5
# (sequence lengths, which continue from their slot, key heads, value heads, key dim, value dim)
CASES = [
    ([1, 1, 1], [True, False, True], 2, 4, 64, 64),
    ([5, 64, 1, 65], [False, True, True, False], 1, 2, 24, 40),
    ([130, 3], [True, False], 2, 2, 128, 48),
    ([150], [False], 1, 3, 16, 16),
]


def _inputs(lengths, hk, hv, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, hk, dk, generator=gen)
    k = torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(t, hv, generator=gen)) * 0.5  # log-decays <= 0, as the layer's
    beta = torch.rand(t, hv, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, g, beta, cu


def _oracle(q, k, v, g, beta, cu, states, has_state):
    """transformers' functions per sequence: (o [T, Hv, Dv], final states by sequence)."""
    outs, finals = [], []
    for i in range(len(cu) - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        init = states[i][None] if has_state[i] else None
        fn = hf.torch_recurrent_gated_delta_rule if b - a == 1 else hf.torch_chunk_gated_delta_rule
        o, s = fn(q[None, a:b], k[None, a:b], v[None, a:b], g=g[None, a:b], beta=beta[None, a:b],
                  initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        finals.append(s[0])
    return torch.cat(outs), finals


def _run(ops, q, k, v, g, beta, cu, states, has_state, slots):
    pool = torch.randn(len(slots) + 2, *states[0].shape)  # spare slots hold garbage
    for i, slot in enumerate(slots):
        pool[slot] = states[i]
    o = ops.gated_delta_rule(q, k, v, g, beta, pool, cu, torch.tensor(slots),
                             torch.tensor(has_state), q.shape[-1] ** -0.5)
    return o, [pool[slot] for slot in slots]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_gated_delta_rule_matches_transformers_per_sequence(case):
    lengths, has_state, hk, hv, dk, dv = CASES[case]
    q, k, v, g, beta, cu = _inputs(lengths, hk, hv, dk, dv, seed=case)
    states = [torch.randn(hv, dk, dv) * 0.1 for _ in lengths]
    slots = [len(lengths) + 1 - i for i in range(len(lengths))]  # reversed, spare slots between
    want, want_states = _oracle(q, k, v, g, beta, cu, states, has_state)
    got, got_states = _run(ReferenceOps(), q, k, v, g, beta, cu, states, has_state, slots)
    assert rel_err_per_seq(got, want, cu) < TOL
    for got_s, want_s in zip(got_states, want_states):
        assert rel_err(got_s, want_s) < TOL


def test_gated_delta_rule_negative_controls_fail():
    """The check above catches a state from the wrong slot and a decay one token late."""
    lengths, has_state, hk, hv, dk, dv = [70, 1], [True, True], 1, 2, 32, 32
    q, k, v, g, beta, cu = _inputs(lengths, hk, hv, dk, dv, seed=7)
    states = [torch.randn(hv, dk, dv) for _ in lengths]
    want, _ = _oracle(q, k, v, g, beta, cu, states, has_state)
    swapped, _ = _run(ReferenceOps(), q, k, v, g, beta, cu, states[::-1], has_state, [0, 1])
    assert rel_err_per_seq(swapped, want, cu) > 100 * TOL
    late = torch.cat([g[:1], g[:-1]])
    shifted, _ = _run(ReferenceOps(), q, k, v, late, beta, cu, states, has_state, [0, 1])
    assert rel_err_per_seq(shifted, want, cu) > 100 * TOL


def test_chunked_and_recurrent_forms_agree_across_chunk_boundaries():
    """Our own two forms on one 150-token sequence (three chunks, the last partial)."""
    q, k, v, g, beta, _ = _inputs([150], 2, 2, 24, 40, seed=3)
    qn = la.l2_normalize(q) * 24 ** -0.5
    kn = la.l2_normalize(k)
    s0 = torch.randn(2, 24, 40)
    o1, s1 = la.recurrent_step(qn, kn, v, g, beta, s0)
    o2, s2 = la.chunked(qn, kn, v, g, beta, s0)
    assert rel_err(o2, o1) < TOL and rel_err(s2, s1) < TOL


@pytest.mark.parametrize("lengths,has_state", [([1, 1, 1], [True, True, False]),
                                               ([7, 1, 2], [False, True, True])])
def test_causal_conv1d_matches_transformers(lengths, has_state):
    gen = torch.Generator().manual_seed(len(lengths))
    channels, width = 40, 4
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    states = torch.randn(len(lengths), channels, width - 1, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    pool = torch.zeros(len(lengths) + 1, channels, width - 1)
    slots = list(range(1, len(lengths) + 1))
    pool[slots] = states
    got = ReferenceOps().causal_conv1d(x, weight, None, pool, cu, torch.tensor(slots),
                                       torch.tensor(has_state))
    for i, n in enumerate(lengths):
        rows = x[int(cu[i]):int(cu[i + 1])].t()[None]  # [1, C, n]
        if has_state[i]:
            state = states[i][None].clone()
            want = hf.causal_conv1d_update(rows, state, weight, None, activation="silu")[0].t()
        else:
            want = hf.causal_conv1d_fn(rows, weight, None, activation="silu")[0].t()
            padded = F.pad(rows[0], (width - 1, 0))
            state = padded[:, -(width - 1):][None]
        assert rel_err(got[int(cu[i]):int(cu[i + 1])], want) < TOL
        assert torch.equal(pool[slots[i]], state[0])


def test_gated_rms_norm_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    x, z = torch.randn(9, 48, generator=gen), torch.randn(9, 48, generator=gen)
    norm = hf.Qwen3_5RMSNormGated(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=gen))
        want = norm(x, z)
    assert rel_err(ReferenceOps().gated_rms_norm(x, z, norm.weight.detach(), 1e-6), want) < TOL
