"""Linear attention of hybrid models for CUDA in Triton (ops/reference/linear_attention.py defines
both ops): the causal conv1d and the gated delta rule over packed sequences of any lengths, prefill
chunks and one-token decodes in one launch, each sequence reading and writing its own state slot.

- causal_conv1d: one program per (sequence, block of channels) walks its sequence in tiles of
  tokens; every output reads its K inputs directly (from x, or from the slot's conv state for the
  first K - 1 positions, zeros where the sequence has no state), so tokens are independent. The
  slot's new conv state (its last K - 1 inputs) is gathered into registers, then written after a
  barrier: the program's own reads of the old state come first.
- gated_delta_rule: one program per (sequence, value head, block of value columns) holds its
  [Dk, BLOCK_V] slice of the state S in float32 registers over the sequence's tokens (the columns
  of S evolve independently: k is shared), then writes it back to the slot. A decode call (one
  token per sequence, known from shapes) takes the recurrence; any other call the chunked WY form
  of reference.chunked, in blocks of DELTA_CHUNK tokens: per block the matmuls K K^T, K S, Q K^T,
  Q S, the unit lower-triangular system solved by forward substitution row by row, one matmul for
  the outputs and one for the state's update (a one-token sequence is a block of one).

All grids come from shapes alone (sequences, heads, channels), the slot index is read on the
device, and a slot < 0 (the padded rows of a CUDA graph's batch) writes nothing: a decode step takes
no host sync and a CUDA graph can capture it. Outputs are written in float32 and cast by torch (the
interpreter's narrowing casts truncate); the recurrent state must be float32 (its in-place write
then casts nothing); the conv state holds x's dtype, so its write copies bits.

Loaded by file path by vlinfer/ops/cuda/loader.py (triton/ is not a package); tests run it under
the Triton interpreter. Reductions go through tl.reduce with triton's own combine (as in
paged_attention.py: the interpreter cannot run tl.sum when triton was imported before
TRITON_INTERPRET was set).
"""
import torch
import triton
import triton.language as tl

L2_EPS = 1e-6  # reference.l2_normalize's
CONV_BLOCK_C, CONV_BLOCK_T = 64, 16
DELTA_BLOCK_V = 32  # value columns per program: a [Dk, 32] float32 state slice in registers
DELTA_CHUNK = 16  # tokens per block of the chunked kernel: its within-block matmuls are 16 x 16


@triton.jit
def _causal_conv1d_kernel(x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, cu_ptr, slot_ptr, has_ptr,
                          x_stride_t, C, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = chans < C
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    live = slot >= 0
    carried = (tl.load(has_ptr + seq) != 0) & live
    # the slot's row of this channel block: conv_state [slots, C, WIDTH - 1], contiguous
    state_row = state_ptr + slot * C * (WIDTH - 1) + chans * (WIDTH - 1)
    bias = tl.full([BLOCK_C], 0.0, tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + chans, mask=cmask, other=0.0).to(tl.float32)
    rows = tl.arange(0, BLOCK_T)
    for t0 in range(start, end, BLOCK_T):
        pos = t0 + rows  # [BLOCK_T] absolute token rows
        tmask = (pos < end)[:, None] & cmask[None, :] & live
        acc = tl.full([BLOCK_T, BLOCK_C], 0.0, tl.float32) + bias[None, :]
        for j in tl.static_range(WIDTH):
            src = pos - (WIDTH - 1) + j  # the input this tap reads
            in_seq = (src >= start)[:, None]
            from_x = tl.load(x_ptr + src[:, None] * x_stride_t + chans[None, :],
                             mask=tmask & in_seq, other=0.0).to(tl.float32)
            # before the sequence: the slot's stored inputs, index WIDTH - 1 + (src - start)
            past = (WIDTH - 1 + src - start)[:, None]
            from_state = tl.load(state_row[None, :] + past, mask=tmask & ~in_seq & carried,
                                 other=0.0).to(tl.float32)
            w = tl.load(w_ptr + chans * WIDTH + j, mask=cmask, other=0.0).to(tl.float32)
            acc += (from_x + from_state) * w[None, :]
        silu = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + pos[:, None] * C + chans[None, :], silu, mask=tmask)
    # the new conv state: the last WIDTH - 1 inputs of (old state, sequence)
    taps = tl.arange(0, BLOCK_W)  # WIDTH - 1 of them, padded to a power of two
    src = end - (WIDTH - 1) + taps
    in_seq = (src >= start)[None, :]
    smask = cmask[:, None] & (taps < WIDTH - 1)[None, :] & live
    from_x = tl.load(x_ptr + src[None, :] * x_stride_t + chans[:, None], mask=smask & in_seq,
                     other=0.0)
    from_state = tl.load(state_row[:, None] + (WIDTH - 1 + src - start)[None, :],
                         mask=smask & ~in_seq & carried, other=0.0)
    tl.debug_barrier()  # every read of the old state above before it is overwritten
    tl.store(state_row[:, None] + taps[None, :], tl.where(in_seq, from_x, from_state), mask=smask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                  has_state: torch.Tensor) -> torch.Tensor:
    """reference.causal_conv1d's contract, in one launch; x [T, C] with unit stride along C,
    conv_state [slots, C, K - 1] contiguous (x is cast to its dtype first, as the reference does);
    a slot < 0 writes nothing and gives zeros."""
    tokens, channels = x.shape
    width = weight.shape[1]
    if width < 2 or weight.shape[0] != channels or conv_state.shape[1:] != (channels, width - 1):
        raise ValueError(
            f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_state "
            f"{tuple(conv_state.shape)} do not match")
    if not conv_state.is_contiguous():
        raise ValueError("causal_conv1d: the conv state must be contiguous")
    dtype, x = x.dtype, x.to(conv_state.dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.zeros(tokens, channels, dtype=torch.float32, device=x.device)
    seqs = cu_seqlens.shape[0] - 1
    if tokens and seqs:
        grid = (seqs, triton.cdiv(channels, CONV_BLOCK_C))
        _causal_conv1d_kernel[grid](
            x, weight.contiguous(), bias if bias is not None else weight, conv_state, out,
            cu_seqlens, slots, has_state.to(torch.int32), x.stride(0), channels, WIDTH=width,
            HAS_BIAS=bias is not None, BLOCK_C=CONV_BLOCK_C, BLOCK_T=CONV_BLOCK_T,
            BLOCK_W=triton.next_power_of_2(width - 1))
    return out.to(dtype)


@triton.jit
def _gated_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, cu_ptr,
                             slot_ptr, has_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                             v_stride_t, v_stride_h, gb_stride_t, scale, HV: tl.constexpr,
                             GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, EPS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dims = tl.arange(0, BLOCK_K)
    kmask, vmask = dims < DK, cols < DV
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    live = slot >= 0
    carried = (tl.load(has_ptr + seq) != 0) & live
    # state [slots, HV, DK, DV] float32, contiguous
    s_ptrs = state_ptr + ((slot * HV + head) * DK + dims[:, None]) * DV + cols[None, :]
    smask = kmask[:, None] & vmask[None, :] & live
    s = tl.load(s_ptrs, mask=smask & carried, other=0.0)
    key_head = head // GROUP  # value heads served by one key head are consecutive
    for t in range(start, end):
        q = tl.load(q_ptr + t * q_stride_t + key_head * q_stride_h + dims, mask=kmask,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * k_stride_t + key_head * k_stride_h + dims, mask=kmask,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * v_stride_t + head * v_stride_h + cols, mask=vmask,
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * gb_stride_t + head).to(tl.float32)
        beta = tl.load(beta_ptr + t * gb_stride_t + head).to(tl.float32)
        q = q * scale / tl.sqrt(tl.reduce(q * q, 0, tl.standard._sum_combine) + EPS)
        k = k / tl.sqrt(tl.reduce(k * k, 0, tl.standard._sum_combine) + EPS)
        s = s * tl.exp(g)
        # S^T k per value column, then the delta rule's rank-one update
        recalled = tl.reduce(s * k[:, None], 0, tl.standard._sum_combine)
        s = s + k[:, None] * (beta * (v - recalled))[None, :]
        o = tl.reduce(s * q[:, None], 0, tl.standard._sum_combine)
        tl.store(out_ptr + (t * HV + head) * DV + cols, o, mask=vmask & live)
    tl.store(s_ptrs, s, mask=smask)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _gated_delta_rule_chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr,
                                     cu_ptr, slot_ptr, has_ptr, q_stride_t, q_stride_h,
                                     k_stride_t, k_stride_h, v_stride_t, v_stride_h, gb_stride_t,
                                     scale, HV: tl.constexpr, GROUP: tl.constexpr,
                                     DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                                     BLOCK_V: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr):
    """reference.chunked per (sequence, value head, value columns), blocks of BT tokens: within a
    block of cumulative log-decays G, (I + L) U = beta V - (beta e^G) K S, solved by forward
    substitution; O = (e^G Q) S + (M * Q K^T) U; S = e^(G_n) S + K^T (e^(G_n - G) U). Rows past
    the sequence load g = 0 and beta = 0: they add nothing and leave G_n at the last real row."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dims = tl.arange(0, BLOCK_K)
    kmask, vmask = dims < DK, cols < DV
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    live = slot >= 0
    carried = (tl.load(has_ptr + seq) != 0) & live
    s_ptrs = state_ptr + ((slot * HV + head) * DK + dims[:, None]) * DV + cols[None, :]
    smask = kmask[:, None] & vmask[None, :] & live
    s = tl.load(s_ptrs, mask=smask & carried, other=0.0)
    key_head = head // GROUP
    rows = tl.arange(0, BT)
    lower = rows[:, None] >= rows[None, :]  # j <= i
    strict = rows[:, None] > rows[None, :]  # j < i
    for c0 in range(start, end, BT):
        pos = c0 + rows
        tmask = (pos < end) & live
        qk_mask = tmask[:, None] & kmask[None, :]
        q = tl.load(q_ptr + pos[:, None] * q_stride_t + key_head * q_stride_h + dims[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + pos[:, None] * k_stride_t + key_head * k_stride_h + dims[None, :],
                    mask=qk_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + pos[:, None] * v_stride_t + head * v_stride_h + cols[None, :],
                    mask=tmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + pos * gb_stride_t + head, mask=tmask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + pos * gb_stride_t + head, mask=tmask, other=0.0).to(tl.float32)
        q = q * (scale / tl.sqrt(_sum(q * q, 1) + EPS))[:, None]
        k = k / tl.sqrt(_sum(k * k, 1) + EPS)[:, None]
        cum = _sum(tl.where(lower, g[None, :], 0.0), 1)  # G_i = g_1 + ... + g_i
        # M: e^(G_i - G_j) on and below the diagonal (the exponent masked first: no overflow)
        decay = tl.where(lower, tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        lmat = tl.where(strict, decay * kk * beta[:, None], 0.0)
        u = beta[:, None] * v - (beta * tl.exp(cum))[:, None] * tl.dot(k, s, input_precision="ieee")
        for i in range(1, BT):  # row i of U from the rows before it, already final
            l_row = _sum(tl.where((rows == i)[:, None], lmat, 0.0), 0)  # L[i, :], zero from i on
            u = tl.where((rows == i)[:, None], u - _sum(l_row[:, None] * u, 0)[None, :], u)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        o = tl.dot(tl.exp(cum)[:, None] * q, s, input_precision="ieee") \
            + tl.dot(decay * qk, u, input_precision="ieee")
        tl.store(out_ptr + (pos[:, None] * HV + head) * DV + cols[None, :], o,
                 mask=tmask[:, None] & vmask[None, :])
        last = _sum(tl.where(rows == BT - 1, cum, 0.0), 0)  # G_n
        s = tl.exp(last) * s + tl.dot(tl.trans(k), tl.exp(last - cum)[:, None] * u,
                                      input_precision="ieee")
    tl.store(s_ptrs, s, mask=smask)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                     slots: torch.Tensor, has_state: torch.Tensor, scale: float) -> torch.Tensor:
    """reference.gated_delta_rule's contract, in one launch: q, k [T, Hk, Dk], v [T, Hv, Dv] with
    unit stride along the head dim, g / beta [T, Hv], state [slots, Hv, Dk, Dv] float32 and
    contiguous; a slot < 0 writes nothing and gives zeros. Returns o [T, Hv, Dv] in v's dtype."""
    tokens, key_heads, dk = k.shape
    value_heads, dv = v.shape[1:]
    if q.shape != k.shape or value_heads % key_heads or state.shape[1:] != (value_heads, dk, dv) \
            or g.shape != (tokens, value_heads) or beta.shape != g.shape:
        raise ValueError(
            f"gated_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g "
            f"{tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)} do not match")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(
            f"gated_delta_rule: the state must be a contiguous float32 pool, not {state.dtype}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    g, beta = g.float().contiguous(), beta.float().contiguous()
    out = torch.zeros(tokens, value_heads, dv, dtype=torch.float32, device=v.device)
    seqs = cu_seqlens.shape[0] - 1
    if tokens and seqs:
        # tl.dot takes 16 at least in each dim (the chunked kernel's blocks)
        block_v = max(16, min(DELTA_BLOCK_V, triton.next_power_of_2(dv)))
        grid = (seqs, value_heads, triton.cdiv(dv, block_v))
        decode = tokens == seqs  # shapes alone: one token per sequence (no host sync)
        kernel = _gated_delta_rule_kernel if decode else _gated_delta_rule_chunked_kernel
        extra = {} if decode else {"BT": DELTA_CHUNK}
        kernel[grid](
            q, k, v, g, beta, state, out, cu_seqlens, slots, has_state.to(torch.int32),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), scale, HV=value_heads, GROUP=value_heads // key_heads, DK=dk, DV=dv,
            BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v, EPS=L2_EPS, **extra)
    return out.to(v.dtype)
