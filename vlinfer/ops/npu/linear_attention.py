"""Linear attention of hybrid models on the Ascend NPU (ops/reference/linear_attention.py defines
it) on torch_npu's Gated DeltaNet operators (docs/npu-ops.md §2.12 - §2.14):
- a decode call (one token per sequence): npu_recurrent_gated_delta_rule, in place on the slots;
- prefill chunks and mixed calls: npu_chunk_gated_delta_rule over the packed sequences, the
  initial states gathered from the slots (zeros where not has_state), the final ones put back;
- the causal conv1d: the reference, logged (torch_npu's causal conv ops are Ascend 950 only and
  take kernel width 3, §2.14).

The state's layout, decided here (`state_pool`): both ops keep S value-major, [slots, Hv, Dv, Dk],
the reference key-major. The NPU table's pool is allocated value-major and handed to the layers as
its transposed view, of the reference's logical shape [slots, Hv, Dk, Dv]: the reference, slot
copies and checkpoints read it as any pool, and the ops take `state.transpose(-1, -2)`, contiguous,
with no copy per step.

The rule (`why_not`): bf16 q / k / v and a bf16 state in that layout, the op present in this
torch_npu; the chunk op also its head limits and a log-decay g >= -1 (its page: outside [-1, 0]
the result may overflow), read on the host once per prefill call. Anything else runs the
reference, logged once per reason. Neither op normalises q and k: they are L2-normalised here as
the reference normalises them, then rounded to bf16."""
import torch

from vlinfer.ops.reference import linear_attention as reference

OP_DTYPE = torch.bfloat16  # q / k / v / beta / state: bf16 only on Atlas A2 / A3 (§2.12, §2.13)
STATE_KERNEL_DTYPES = (OP_DTYPE,)
RECURRENT, CHUNK = "npu_recurrent_gated_delta_rule", "npu_chunk_gated_delta_rule"
CHUNK_MAX_HEADS, CHUNK_MAX_DIM = 64, 128  # the chunk op's Nk, Nv and Dk, Dv limits (§2.13)
CONV_FALLBACK = ("torch_npu's causal conv1d ops (npu_fused_causal_conv1d, "
                 "npu_masked_causal_conv1d) run on Ascend 950 only and take kernel width 3 "
                 "(npu-ops.md §2.14)")

# Why hybrid decode runs eager on the NPU (ModelRunner logs it; gated_delta_rule raises it if a
# capture reaches the op anyway).
GRAPH_REFUSAL = (f"{RECURRENT} is documented for single-op and static graph modes, not ACL graph "
                 "capture (npu-ops.md §2.12), and the causal conv1d runs the reference, which "
                 "reads lengths on the host")


def state_pool(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed pool of logical shape [..., Hv, Dk, Dv] stored value-major ([..., Hv, Dv, Dk])."""
    *lead, dk, dv = shape
    return torch.zeros(*lead, dv, dk, dtype=dtype, device=device).transpose(-1, -2)


def is_decode(q: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    # One token per sequence, told from shapes; the op checks each length is 1..8 itself.
    return q.shape[0] == cu_seqlens.shape[0] - 1


def why_not(torch_npu, op: str, q, v, g, state, cu_seqlens) -> str | None:
    """Why this call cannot run `op` (None: it can). A prefill call reads its lengths and g's
    minimum on the host."""
    if not hasattr(torch_npu, op):
        return f"this torch_npu has no {op}"
    if q.dtype != OP_DTYPE or state.dtype != OP_DTYPE:
        return (f"{op} takes bfloat16 activations and state only (npu-ops.md §2.12, §2.13); "
                f"set mamba_ssm_cache_dtype=bfloat16 with a bfloat16 model to run it")
    if not state.transpose(-1, -2).is_contiguous():
        return "the state pool is not in the ops' value-major layout [slots, Hv, Dv, Dk]"
    if op == RECURRENT:
        return None
    heads, dims = (q.shape[1], v.shape[1]), (q.shape[2], v.shape[2])
    if max(heads) > CHUNK_MAX_HEADS or max(dims) > CHUNK_MAX_DIM:
        return (f"{op} takes at most {CHUNK_MAX_HEADS} heads of at most {CHUNK_MAX_DIM} "
                f"(Nk, Nv = {heads}, Dk, Dv = {dims})")
    if bool((torch.diff(cu_seqlens) < 1).any()):
        return f"{op} takes no empty sequence"
    if g.numel() and g.min().item() < -1:
        return f"{op} needs the log-decay g >= -1 (npu-ops.md §2.13: else it may overflow)"
    return None


def fresh_slots(slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor | None:
    """The slots of a decode call that start from zeros (a one-token first chunk), or None: one
    host read per step (NpuOps keeps it in a PerStep cache)."""
    if bool(has_state.all()):
        return None
    return slots[~has_state].long()


def gated_delta_rule(ops, q, k, v, g, beta, state, cu_seqlens, slots, has_state, scale):
    if ops._capture is not None:  # the model runner keeps hybrid models eager; said if not
        raise RuntimeError(f"{GRAPH_REFUSAL}: hybrid decode runs eager")
    torch_npu = ops._torch_npu
    decode = is_decode(q, cu_seqlens)
    op = RECURRENT if decode else CHUNK
    why = why_not(torch_npu, op, q, v, g, state, cu_seqlens)
    if why is not None:
        ops._warn_fallback(f"gated_delta_rule ({'decode' if decode else 'prefill'})", q.dtype,
                           why)
        return reference.gated_delta_rule(q, k, v, g, beta, state, cu_seqlens, slots, has_state,
                                          scale)
    pool = state.transpose(-1, -2)  # [slots, Hv, Dv, Dk], contiguous
    q = reference.l2_normalize(q.float()).to(OP_DTYPE).contiguous()
    k = reference.l2_normalize(k.float()).to(OP_DTYPE).contiguous()
    args = dict(beta=beta.to(OP_DTYPE).contiguous(), scale=scale, g=g.float().contiguous(),
                actual_seq_lengths=torch.diff(cu_seqlens).to(torch.int32))
    if decode:
        fresh = ops._state_step.get(fresh_slots, slots, has_state)
        if fresh is not None:
            pool[fresh] = 0
        o = torch_npu.npu_recurrent_gated_delta_rule(q, k, v.contiguous(), pool,
                                                     ssm_state_indices=slots.to(torch.int32),
                                                     **args)
        return o.to(v.dtype)
    index = slots.long()
    initial = torch.where(has_state.view(-1, 1, 1, 1), pool[index], 0).contiguous()
    o, final = torch_npu.npu_chunk_gated_delta_rule(q, k, v.contiguous(), initial_state=initial,
                                                    **args)
    pool[index] = final.to(pool.dtype)
    return o.to(v.dtype)


def causal_conv1d(ops, x, weight, bias, conv_state, cu_seqlens, slots, has_state):
    ops._warn_fallback("causal_conv1d", x.dtype, CONV_FALLBACK)
    ops._no_fallback_in_capture("causal_conv1d", x.dtype, CONV_FALLBACK)
    return reference.causal_conv1d(x, weight, bias, conv_state, cu_seqlens, slots, has_state)
