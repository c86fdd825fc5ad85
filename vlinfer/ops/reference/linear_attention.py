"""Linear attention of hybrid models (Qwen3.5, Qwen3-Next: docs/hybrid.md): the short causal conv1d
over the q/k/v channels and the gated delta rule, both over packed sequences of any lengths (prefill
chunks and one-token decodes in one call), each sequence reading and writing its own state slot.

The state lives in per-sequence slots, not in the paged KV blocks: conv_state [slots, C, K - 1]
holds a sequence's last K - 1 conv inputs, state [slots, Hv, Dk, Dv] its recurrent state (float32 by
default). `has_state[i]` False starts sequence i from zeros (its first chunk); True continues from
its slot (a later chunk, a decode step). Both ops write the final state back to the slot."""
import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per block of the chunked form: its within-chunk matmuls are CHUNK x CHUNK


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                  has_state: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of x [T, C] with weight [C, K] (+ bias [C]) then SiLU, per sequence
    (rows cu_seqlens[i]:cu_seqlens[i+1]), its left context the K - 1 inputs in conv_state[slots[i]]
    (zeros where not has_state[i]); conv_state[slots[i]] gets the last K - 1 inputs seen."""
    width = weight.shape[1]
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for i, (slot, carried) in enumerate(zip(slots.tolist(), has_state.tolist())):
        rows = x[bounds[i]:bounds[i + 1]].t().to(conv_state.dtype)  # [C, n]
        past = conv_state[slot] if carried else torch.zeros_like(conv_state[slot])
        window = torch.cat([past, rows], dim=1)  # [C, K - 1 + n]
        conv_state[slot] = window[:, window.shape[1] - (width - 1):]
        y = F.conv1d(window.to(weight.dtype)[None], weight[:, None, :], bias,
                     groups=weight.shape[0])[0]  # [C, n]: every output has its K inputs
        out[bounds[i]:bounds[i + 1]] = F.silu(y.float()).t().to(x.dtype)
    return out


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as the FLA kernels Qwen3.5 was trained with."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                     slots: torch.Tensor, has_state: torch.Tensor, scale: float) -> torch.Tensor:
    """The gated delta rule over packed sequences: q, k [T, Hk, Dk] (L2-normalised here), v
    [T, Hv, Dv], log-decay g [T, Hv] and beta [T, Hv]; each key head serves Hv / Hk consecutive
    value heads. Per token and value head, with S the [Dk, Dv] state:
        S = exp(g) S;  S = S + beta k (v - S^T k)^T;  o = scale * S^T q.
    Returns o [T, Hv, Dv] in v's dtype; state[slots[i]] holds sequence i's final S. One-token
    sequences take the recurrence, longer ones the chunked form (the same arithmetic, blocked)."""
    group = v.shape[1] // k.shape[1]
    q = l2_normalize(q.float()).repeat_interleave(group, dim=1) * scale
    k = l2_normalize(k.float()).repeat_interleave(group, dim=1)
    v32, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for i, (slot, carried) in enumerate(zip(slots.tolist(), has_state.tolist())):
        a, b = bounds[i], bounds[i + 1]
        s0 = state[slot].float() if carried else torch.zeros_like(state[slot], dtype=torch.float32)
        step = recurrent_step if b - a == 1 else chunked
        out[a:b], final = step(q[a:b], k[a:b], v32[a:b], g[a:b], beta[a:b], s0)
        state[slot] = final.to(state.dtype)
    return out.to(v.dtype)


def recurrent_step(q, k, v, g, beta, s):
    """Token by token (float32, heads first): q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H], s
    [H, Dk, Dv]. Returns (o [n, H, Dv], final s)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def chunked(q, k, v, g, beta, s):
    """recurrent_step's result by blocks of CHUNK tokens. Within a block of cumulative log-decays G
    (G_i = g_1 + ... + g_i), the updates u_i = beta_i (v_i - (decayed S_{i-1})^T k_i) solve the unit
    lower-triangular system (I + L) U = beta V - (beta e^G) K S0, L_ij = beta_i e^(G_i - G_j)
    k_i.k_j for j < i; then O = (e^G Q) S0 + (M * Q K^T) U with M_ij = e^(G_i - G_j) for j <= i, and
    the block's final state is e^(G_n) S0 + K^T (e^(G_n - G) U)."""
    out = torch.empty_like(v)
    for c in range(0, q.shape[0], CHUNK):
        # heads first: [H, n, D]
        qc, kc, vc = (x[c:c + CHUNK].transpose(0, 1) for x in (q, k, v))
        gc, bc = g[c:c + CHUNK].t(), beta[c:c + CHUNK].t()  # [H, n]
        n = qc.shape[1]
        cum = gc.cumsum(-1)  # G
        diff = cum[:, :, None] - cum[:, None, :]  # G_i - G_j
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = diff.masked_fill(~lower, float("-inf")).exp()  # M: zero above the diagonal
        # L: beta_i e^(G_i - G_j) k_i.k_j strictly below the diagonal
        strict = (decay * (kc @ kc.transpose(-1, -2)) * bc[:, :, None]).tril(-1)
        rhs = bc[:, :, None] * vc - (bc * cum.exp())[:, :, None] * (kc @ s)
        eye = torch.eye(n, device=q.device).expand_as(strict)
        u = torch.linalg.solve_triangular(eye + strict, rhs, upper=False, unitriangular=True)
        o = (cum.exp()[:, :, None] * qc) @ s + (decay * (qc @ kc.transpose(-1, -2))) @ u
        out[c:c + n] = o.transpose(0, 1)
        last = cum[:, -1:]  # G_n
        s = last.exp()[:, :, None] * s + kc.transpose(-1, -2) @ ((last - cum).exp()[:, :, None] * u)
    return out, s


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] (float32 statistics, weight applied in x's dtype) times SiLU(gate),
    the output norm of a Gated DeltaNet layer per value head."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed).float() * F.silu(gate.float())).to(x.dtype)
