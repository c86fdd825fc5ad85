"""The emulated torch_npu's Gated DeltaNet operators (registered on FakeTorchNpu by
tests/fakes/fake_torch_npu.py): npu_recurrent_gated_delta_rule and npu_chunk_gated_delta_rule.

Written from their torch_npu API pages in Ascend/op-plugin (docs/npu-ops.md §2.12, §2.13) and the
golden function of op-plugin's test_npu_recurrent_gated_delta_rule.py, not from
vlinfer/ops/reference/linear_attention.py: the state is value-major, S [Dv, Dk] per value head, and
per token S = e^g S Diag(e^gk); S = S + beta (v - S k) k^T; o = S (q scale). Neither op normalises
q or k; each checks what its page states (dtypes, shapes, ranges, the arguments op-plugin's C++
requires) and raises FakeNpuError on a call the device would reject or compute wrongly. The chunk
op is emulated token by token: its page defines it as the recurrence computed in blocks.

Interpretations (the pages leave them open):
- "query/key need normalising" (the chunk page; the recurrent page's example does it): each row's
  L2 norm must be 1 within bf16 rounding, so a caller that forgets to normalise is caught.
- The chunk op's "-1 <= g <= 0, else the result may overflow" is a rejection here.
- beta's "(0, 1)" is checked as [0, 1]: a bf16 sigmoid rounds to either end.
- ssm_state_indices repeated within a call: undefined on the device (each token writes its own
  state), rejected here. actual_seq_lengths of the chunk op are per-sequence lengths summing to T,
  as its parameter table says (its graph-mode example passes cumulative ends instead).
- The state is carried in float32 across a sequence's tokens and rounded to bf16 where it is
  written, as op-plugin's golden function does.
"""
import torch

from fake_torch_npu import _require

BF16 = torch.bfloat16
MAX_TOKENS_PER_SEQ = 8  # the recurrent op's 1 <= L_i <= 8
NORM_TOLERANCE = 1e-2  # a bf16-rounded unit vector's norm is 1 within a few 2^-9


def _check(t, name, dtype, dims, contiguous=True):
    _require(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    _require(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    _require(t.dim() == dims, f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if contiguous:
        _require(t.is_contiguous(), f"{name} must be contiguous (ND format)")


def _normalised(x, name):
    norms = x.float().norm(dim=-1)
    _require(bool(((norms - 1).abs() < NORM_TOLERANCE).all()),
             f"{name} rows must be L2-normalised (the op does not normalise them)")


def _common(query, key, value, beta, g, max_heads, max_dim):
    """Shapes and dtypes the two pages share; returns (T, Nk, Nv, Dk, Dv)."""
    for t, n in ((query, "query"), (key, "key"), (value, "value")):
        _check(t, n, BF16, 3)
    tokens, nk, dk = query.shape
    _require(tuple(key.shape) == (tokens, nk, dk), "key must have query's shape [T, Nk, Dk]")
    _require(value.shape[0] == tokens, "value must be [T, Nv, Dv] with query's T")
    nv, dv = value.shape[1:]
    _require(0 < nk <= max_heads and 0 < nv <= max_heads and nv % nk == 0,
             f"Nk={nk}, Nv={nv}: need 0 < Nk, Nv <= {max_heads} and Nv % Nk == 0")
    _require(0 < dk <= max_dim and 0 < dv <= max_dim, f"Dk={dk}, Dv={dv} must be in 1..{max_dim}")
    _check(beta, "beta", BF16, 2)
    _require(tuple(beta.shape) == (tokens, nv), "beta must be [T, Nv]")
    _require(bool(((beta >= 0) & (beta <= 1)).all()), "beta must lie in (0, 1)")
    if g is not None:
        _check(g, "g", torch.float32, 2)
        _require(tuple(g.shape) == (tokens, nv), "g must be [T, Nv]")
    _normalised(query, "query")
    _normalised(key, "key")
    return tokens, nk, nv, dk, dv


def _lengths(lengths, batch_name):
    _check(lengths, batch_name, torch.int32, 1)
    return lengths.tolist()


def _step(s, q, k, v, alpha, beta):
    """One token of one value head, value-major S [Dv, Dk]: decay, delta update, output."""
    s = s * alpha
    s = s + beta * (v - s @ k)[:, None] * k[None, :]
    return s, s @ q


def _recurrent_gated_delta_rule(module, query, key, value, state, *, beta=None, scale=None,
                                actual_seq_lengths=None, ssm_state_indices=None,
                                num_accepted_tokens=None, g=None, gk=None):
    """§2.12: o [T, Nv, Dv] bf16; state [BlockNum, Nv, Dv, Dk] bf16 updated in place, token t's
    state written to state[ssm_state_indices[t]], sequence i starting from the state of its token
    num_accepted_tokens[i] - 1 (1 when None)."""
    _require(scale is not None, "scale cannot be empty (op-plugin's TORCH_CHECK)")
    _require(beta is not None, "beta is required here (None means ones; not emulated)")
    tokens, nk, nv, dk, dv = _common(query, key, value, beta, g, 256, 512)
    _check(state, "state", BF16, 4)
    _require(tuple(state.shape[1:]) == (nv, dv, dk),
             f"state must be [BlockNum, Nv, Dv, Dk] = [*, {nv}, {dv}, {dk}] (value-major), got "
             f"{tuple(state.shape)}")
    _require(state.shape[0] >= tokens, "BlockNum must be at least T")
    lengths = _lengths(actual_seq_lengths, "actual_seq_lengths")
    _require(all(1 <= n <= MAX_TOKENS_PER_SEQ for n in lengths) and sum(lengths) == tokens,
             f"actual_seq_lengths {lengths} must each be in 1..{MAX_TOKENS_PER_SEQ} and sum to T")
    _check(ssm_state_indices, "ssm_state_indices", torch.int32, 1)
    index = ssm_state_indices.tolist()
    _require(len(index) == tokens, "ssm_state_indices must be [T]: one state per token")
    _require(all(0 <= i < state.shape[0] for i in index), "ssm_state_indices out of [0, BlockNum)")
    _require(len(set(index)) == len(index), "ssm_state_indices has duplicates")
    accepted = [1] * len(lengths)
    if num_accepted_tokens is not None:
        accepted = _lengths(num_accepted_tokens, "num_accepted_tokens")
        _require(len(accepted) == len(lengths) and all(
            1 <= a <= n for a, n in zip(accepted, lengths)), "num_accepted_tokens out of 1..L_i")
    if gk is not None:
        _check(gk, "gk", torch.float32, 3)
        _require(tuple(gk.shape) == (tokens, nv, dk), "gk must be [T, Nv, Dk]")
    group = nv // nk
    out = torch.empty(tokens, nv, dv, dtype=torch.float32)
    start = 0
    for n, a in zip(lengths, accepted):
        first = state[index[start + a - 1]].float()  # read before any write of this call
        for h in range(nv):
            s = first[h]
            for t in range(start, start + n):
                alpha = torch.ones(dk)
                if g is not None:
                    alpha = alpha * g[t, h].exp()
                if gk is not None:
                    alpha = alpha * gk[t, h].exp()
                s, out[t, h] = _step(s, query[t, h // group].float() * scale,
                                     key[t, h // group].float(), value[t, h].float(), alpha[None],
                                     beta[t, h].float())
                state[index[t], h] = s.to(BF16)
        start += n
    return out.to(BF16)


def _chunk_gated_delta_rule(module, query, key, value, *, beta=None, initial_state=None,
                            actual_seq_lengths=None, scale=None, g=None):
    """§2.13: (o [T, Nv, Dv] bf16, final_state [B, Nv, Dv, Dk]); initial_state is not written."""
    for arg, name in ((beta, "beta"), (initial_state, "initial_state"),
                      (actual_seq_lengths, "actual_seq_lengths"), (scale, "scale")):
        _require(arg is not None, f"{name} cannot be empty (op-plugin's TORCH_CHECK)")
    tokens, nk, nv, dk, dv = _common(query, key, value, beta, g, 64, 128)
    # float32 states are Ascend 950 only; this emulates Atlas A2 / A3
    _check(initial_state, "initial_state", BF16, 4)
    lengths = _lengths(actual_seq_lengths, "actual_seq_lengths")
    _require(tuple(initial_state.shape) == (len(lengths), nv, dv, dk),
             f"initial_state must be [B, Nv, Dv, Dk] = [{len(lengths)}, {nv}, {dv}, {dk}] "
             f"(value-major), got {tuple(initial_state.shape)}")
    _require(all(n >= 1 for n in lengths) and sum(lengths) == tokens,
             f"actual_seq_lengths {lengths} must be per-sequence lengths (>= 1) summing to T")
    if g is not None:
        _require(bool(((g >= -1) & (g <= 0)).all()),
                 "g must lie in [-1, 0] (the page: outside it the result may overflow)")
    group = nv // nk
    out = torch.empty(tokens, nv, dv, dtype=torch.float32)
    final = torch.empty(initial_state.shape, dtype=torch.float32)
    start = 0
    for b, n in enumerate(lengths):
        for h in range(nv):
            s = initial_state[b, h].float()
            for t in range(start, start + n):
                alpha = g[t, h].exp() if g is not None else torch.tensor(1.0)
                s, out[t, h] = _step(s, query[t, h // group].float() * scale,
                                     key[t, h // group].float(), value[t, h].float(), alpha,
                                     beta[t, h].float())
            final[b, h] = s
        start += n
    return out.to(BF16), final.to(initial_state.dtype)


GDN_OPS = {"npu_recurrent_gated_delta_rule": _recurrent_gated_delta_rule,
           "npu_chunk_gated_delta_rule": _chunk_gated_delta_rule}
