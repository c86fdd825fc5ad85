"""The NPU op table's host side (backend.py): what this torch_npu release offers, found from its
signatures at load, the host metadata FIA needs, built once per step from the ForwardContext tensors
(each .tolist() is a device->host sync) and kept in an NpuOps' PerStep caches, and the paged FIA
call shapes the eager, int8 and graph paths share (backend.py, kv_cache.py, graph.py). Section
numbers refer to docs/npu-ops.md."""
import inspect
import logging

import torch

logger = logging.getLogger("vlinfer")
HALF_DTYPES = (torch.float16, torch.bfloat16)
HALF_ONLY = "the torch_npu kernel takes float16 or bfloat16 only (npu-ops.md §1)"
# Sparse modes 2-4 take this fixed compressed mask whatever the sequence lengths (§2.3 "Masks",
# OPD:8214).
MASK_SIZE = 2048


# ---- feature detection ----

def param_names(fn) -> set[str] | None:
    """Argument names fn accepts, or None when they cannot be read. A Python signature first; then
    the op schema, for a registered torch op (an OpOverloadPacket shows only *args, **kwargs; a
    pybind builtin shows nothing)."""
    try:
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return set(params)
    except (TypeError, ValueError):
        pass
    try:
        schema = fn.default._schema if hasattr(fn, "default") else getattr(
            torch.ops.npu, fn.__name__).default._schema
        return {a.name for a in schema.arguments}
    except Exception:
        return None


def detect_fia_scale_kwarg(torch_npu) -> str | None:
    # The softmax scale is `scale` in 7.x-era docs and torch_npu 2.14, `scale_value` in 6.0.x pages
    # (§0).
    names = param_names(torch_npu.npu_fused_infer_attention_score)
    if names is None:
        return None  # the first call tries `scale`, then `scale_value` on TypeError
    for kw in ("scale", "scale_value"):
        if kw in names:
            return kw
    raise RuntimeError("npu_fused_infer_attention_score takes neither `scale` nor `scale_value`")


def detect_cache_write(torch_npu) -> str:
    # npu_scatter_pa_kv_cache in "Norm" mode is what vllm-ascend uses on A2/A3; the ATB op is the
    # fallback when it is missing (§2.1, §7.1). A release whose scatter op has no cache_mode only
    # writes NZ caches.
    scatter = getattr(torch_npu, "npu_scatter_pa_kv_cache", None)
    if scatter is not None:
        names = param_names(scatter)
        if names is None or "cache_mode" in names:
            return "npu_scatter_pa_kv_cache"
        logger.warning(
            "ops[npu]: npu_scatter_pa_kv_cache has no cache_mode argument (NZ caches only); "
            "writing the ND cache with _npu_reshape_and_cache")
    if hasattr(torch_npu, "_npu_reshape_and_cache"):
        return "_npu_reshape_and_cache"
    raise RuntimeError("torch_npu has neither npu_scatter_pa_kv_cache nor _npu_reshape_and_cache")


# ---- per-step host metadata (built once per step, kept in an NpuOps' PerStep caches) ----

class AttentionMeta:
    """Host lists FIA needs for one step, and (lazily) the index tensors of the split path."""

    def __init__(self, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor):
        cu = cu_seqlens_q.tolist()
        self.cu = cu
        # TND: cumulative end offsets, the last one equal to T (§2.3 "Sequence lengths")
        self.q_ends = cu[1:]
        self.q_lens = [b - a for a, b in zip(cu, cu[1:])]
        self.kv_lens = seq_lens.tolist()  # with a block table: per-sequence lengths, not cumulative
        self.max_q_len = max(self.q_lens)
        # int32, 2-D, first dim = B; the -1 padding is never read: only ceil(len / block_size)
        # entries are (§1).
        self.block_table = block_tables.to(torch.int32).contiguous()
        self.split = None


def valid_slots(slot_mapping: torch.Tensor):
    # Negative (padding) slots are not documented as skipped by either NPU op (§2.1), so they are
    # dropped here.
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return slot_mapping.to(torch.int32), None
    return slot_mapping[valid].to(torch.int32), valid


def segment_ends(cu_seqlens: torch.Tensor) -> list[int]:
    return cu_seqlens.tolist()[1:]


def causal_mask(device: torch.device) -> torch.Tensor:
    # int8 upper triangle of ones (1 = masked out), as vllm-ascend builds it for sparse_mode 3
    # (§5.3).
    return torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device), diagonal=1)


def paged_kv(k_cache, v_cache):
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return (k_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            v_cache.view(num_blocks, block_size, num_kv_heads * head_dim))


class SplitPlan:
    """Rows and token indices of the split path: decodes as [B, 1, H], prefill chunks padded to [B,
    S, H]."""

    def __init__(self, meta: AttentionMeta, device: torch.device):
        q_lens, cu = meta.q_lens, meta.cu
        self.decode = [i for i, n in enumerate(q_lens) if n == 1]
        self.prefill = [i for i, n in enumerate(q_lens) if n > 1]
        self.decode_tokens = torch.tensor([cu[i] for i in self.decode], dtype=torch.long,
                                          device=device)
        self.max_s = max((q_lens[i] for i in self.prefill), default=0)
        src, dst = [], []
        for j, i in enumerate(self.prefill):
            src.extend(range(cu[i], cu[i + 1]))
            dst.extend(range(j * self.max_s, j * self.max_s + q_lens[i]))
        self.src = torch.tensor(src, dtype=torch.long, device=device)
        self.dst = torch.tensor(dst, dtype=torch.long, device=device)
        rows = torch.tensor(self.decode, dtype=torch.long, device=device)
        self.decode_table = meta.block_table[rows].contiguous()
        rows = torch.tensor(self.prefill, dtype=torch.long, device=device)
        self.prefill_table = meta.block_table[rows].contiguous()


# ---- paged FIA calls: the BSH decode call every attention path shares ----

def bsh_decode_args(q, k_cache, v_cache, block_table, kv_lens, antiquant=None):
    """FIA's (query, key, value) and keywords for a decode of every row of q [B, heads, D] in BSH
    layout over the paged cache (IFA), with an int8 cache's antiquant keywords."""
    num_tokens, num_heads, head_dim = q.shape
    k, v = paged_kv(k_cache, v_cache)
    return (q.reshape(num_tokens, 1, num_heads * head_dim), k,
            v), dict(actual_seq_lengths_kv=kv_lens, block_table=block_table, num_heads=num_heads,
                     num_key_value_heads=k_cache.shape[2], input_layout="BSH",
                     block_size=k_cache.shape[1], **(antiquant or {}))
