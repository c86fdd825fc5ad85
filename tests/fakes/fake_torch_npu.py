"""A pure-torch stand-in for the torch_npu operators vlinfer's NPU path calls, so that path runs on
CPU tensors.

Written from the contracts in docs/npu-ops.md (§2 for each op, §3 for the reference semantics), not
from vlinfer/ops/reference/. Each op checks what that note states (layouts, dtypes, shapes,
block-size limits, sparse modes, keyword names) and raises FakeNpuError on a violation, so a call
the device would reject, or one with undefined results there (duplicate slots, bad block ids), fails
the test. Everything computes in float32 and casts to the input dtype at the end, as §3 prescribes.
What the note leaves open is marked "interpretation". The quantized-linear ops (npu_dynamic_quant,
npu_quantize, npu_quant_matmul, npu_weight_quant_batchmatmul) are in
tests/fakes/fake_torch_npu_quant.py and the MoE ones in tests/fakes/fake_torch_npu_moe.py,
registered here; npu_grouped_matmul (§2.11), which the MoE and LoRA ops share, is here.

Use the `fake_npu` fixture (sys.modules["torch_npu"] plus VLINFER_OPS=npu, undone afterwards: an
engine started in the test runs the NPU ops on it), or install() / loaded() (which also returns an
NpuOps loaded on it) with a monkeypatch for variants standing for other releases:
FakeTorchNpu(fia_scale_kwarg="scale_value") is a 6.0.x-era FIA; opaque=True hides every signature
(names found only by trying), opaque="schema" shows them only in a registered op's schema;
tnd_paged=False rejects TND over a paged cache (the input_layout paragraph of §2.3);
scatter_pa=False lacks npu_scatter_pa_kv_cache; atb=False has ATB ops that raise OSError on first
use (NNAL not sourced, §0); graphs=False lacks the ACL graph APIs; paged_antiquant=False rejects
FIA's antiquant mode 5 (a release without it, §2.10); gdn=False lacks the Gated DeltaNet ops
(npu_recurrent_gated_delta_rule, npu_chunk_gated_delta_rule: tests/fakes/fake_torch_npu_gdn.py).

int8 KV caches (§2.10): FIA takes int8 key/value pages with their per-token, per-head scales in
pages of the cache (key_/value_antiquant_scale (blocknum, N, blocksize) float32, mode 5) for a
decode (Q_S == 1) in a layout other than TND, and rejects int8 pages for longer queries;
npu_scatter_pa_kv_cache and _npu_reshape_and_cache scatter int8 rows as they do half ones;
npu_dynamic_quant (tests/fakes/fake_torch_npu_quant.py) quantizes them.

ACL graphs (§5.1, §5.4; the "graph mode" section below): torch.npu.NPUGraph records what a capture
issues instead of letting Python re-run at replay. Every aten op outside a torch_npu op is recorded
with its tensors (static memory) and re-executed at replay; each torch_npu op is one task, replayed
with the arguments it was captured with: its host arguments (FIA's actual_seq_lengths*, lists of
Python ints) stay the capture's values unless the task was re-issued between
graph_task_update_begin/end. A capture rejects host syncs (.item(), bool(), .tolist(),
data-dependent shapes, synchronize), as the device would.
"""
import collections
import contextlib
import functools
import inspect
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HALF = (torch.float16, torch.bfloat16)
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "TND")
INT_MAX = 2147483647
MASK_SHAPES = ((2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048))


class FakeNpuError(RuntimeError):
    """A call the documented contract rejects (on the device: an error code such as 561002, or
    garbage)."""


def _require(cond, message):
    if not cond:
        raise FakeNpuError(message)


def _host_ints(values, name):
    """SymInt[]: a host list of Python ints (§1 "Host-side lengths"), never a tensor."""
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(
            f"{name} must be a list of Python ints (SymInt[]), got {type(values).__name__}")
    return list(values)


def _per_batch(values, batch, name):
    # Non-TND layouts: one value broadcasts, a longer list is truncated to the first B (§2.3).
    values = _host_ints(values, name)
    if len(values) == 1:
        return values * batch
    _require(len(values) >= batch, f"{name} has {len(values)} entries for batch {batch}")
    return values[:batch]


def _attend(q, k, v, scale, allowed):
    """§3 attend: q [Sq, Hq, D], k [Skv, Hkv, D], v [Skv, Hkv, Dv], allowed [Sq, Skv] -> [Sq, Hq,
    Dv] float32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("ihd,jhd->hij", q.float(), k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a fully masked row gives 0
    return torch.einsum("hij,jhd->ihd", p, v), torch.logsumexp(s, -1)


class FakeTorchNpu(types.ModuleType):
    """The module object placed in sys.modules["torch_npu"]; `calls` counts op calls, `last` keeps
    each op's last keyword arguments and `history` every call's (for tests that check how an op was
    called)."""

    def __init__(self, *, fia_scale_kwarg="scale", opaque=False, tnd_paged=True, scatter_pa=True,
                 atb=True, graphs=True, paged_antiquant=True, gdn=True):
        super().__init__("torch_npu")
        self.__file__ = __file__
        self.calls = collections.Counter()
        self.last = {}
        # (op, keyword arguments with tensors replaced by their shapes), in call order
        self.history = []
        self.tnd_paged = tnd_paged
        self.atb = atb
        self.graphs = graphs
        self.paged_antiquant = paged_antiquant
        # the ACL graph emulation's state (captures, task updates, streams)
        self.graph = GraphState()
        self.fia_fn = _fia_with_scale if fia_scale_kwarg == "scale" else _fia_with_scale_value
        ops = {"npu_fused_infer_attention_score": self.fia_fn, "npu_rotary_mul": _rotary_mul,
               "npu_rms_norm": _rms_norm, "npu_add_rms_norm": _add_rms_norm, "npu_swiglu": _swiglu,
               "_npu_reshape_and_cache": _reshape_and_cache, "npu_grouped_matmul": _grouped_matmul}
        if scatter_pa:
            ops["npu_scatter_pa_kv_cache"] = _scatter_pa_kv_cache
        if graphs:
            ops["_npu_fused_infer_attention_score_get_max_workspace"] = _fia_get_max_workspace
        # the quantized linears' ops (imports this module: here, not above)
        from fake_torch_npu_quant import QUANT_OPS
        ops.update(QUANT_OPS)
        from fake_torch_npu_moe import MOE_OPS  # the fused MoE's ops (imports this module too)
        ops.update(MOE_OPS)
        if gdn:  # Gated DeltaNet's (§2.12, §2.13; tests/fakes/fake_torch_npu_gdn.py)
            from fake_torch_npu_gdn import GDN_OPS
            ops.update(GDN_OPS)
        for name, fn in ops.items():
            setattr(self, name, self._recorded(name, fn, opaque))
        # OPD:8521: the .out overload, an attribute of the op as on a registered torch op
        if graphs:
            self.npu_fused_infer_attention_score.out = self._recorded(FIA_OUT, _fia_out, opaque)

    def _recorded(self, name, fn, opaque):
        module = self

        def call(*args, **kwargs):
            graph = module.graph
            # a re-issue between graph_task_update_begin/end: not run now
            if graph.updating is not None:
                return graph.reissue(name, args, kwargs)
            module.calls[name] += 1
            module.last[name] = kwargs
            module.history.append((name, {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v
                                          for k, v in kwargs.items()}))
            if graph.capturing is not None:
                return graph.record_op(name, fn, module, args, kwargs)
            return fn(module, *args, **kwargs)

        # the documented signature, minus `module`
        params = list(inspect.signature(fn).parameters.values())[1:]
        if opaque:  # inspect sees only (*args, **kwargs); wrong keywords still raise TypeError
            call.__name__ = name
            # like a registered op (OpOverloadPacket): the names are in .default._schema
            if opaque == "schema":
                arguments = [types.SimpleNamespace(name=p.name) for p in params]
                call.default = types.SimpleNamespace(_schema=types.SimpleNamespace(
                    arguments=arguments))
            return call
        wrapped = functools.wraps(fn)(call)
        wrapped.__signature__ = inspect.Signature(params)
        wrapped.__name__ = name
        return wrapped


# ---- §2.1 KV-cache write ----

def _check_slots(slots, capacity, name):
    _require(slots.dim() == 1, f"{name} must be 1-D [T]")
    s = slots.long()
    _require(
        bool(((s >= 0) & (s < capacity)).all()),
        f"{name} out of [0, {capacity}) (negative/padding slots are not documented as skipped)")
    _require(s.unique().numel() == s.numel(),
             f"{name} has duplicates (undefined result on the device)")
    return s


def _scatter_pa_kv_cache(module, key, value, key_cache, value_cache, slot_mapping, *,
                         compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                         cache_mode="PA_NZ"):
    """OPD:6976, the "Norm" case: key [T, N, Dk], caches [num_blocks, block_size, N, Dk], slots
    int32/int64 [T]."""
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError("compressed cache arguments are not emulated")
    if cache_mode == "PA_NZ":
        nz = key_cache.dim() == 4 and key.dim() == 3 \
            and key_cache.shape[1] * 16 == key.shape[1] * key.shape[2] and key_cache.shape[3] == 16
        _require(
            not (key_cache.dim() == 4 and not nz),
            "cache_mode 'PA_NZ' (the default) expects NZ caches [nb, N*D/16, bs, 16]; pass "
            "cache_mode='Norm' "
            "for ND caches [nb, bs, N, D]")
        raise NotImplementedError("the NZ cache layout is not emulated")
    _require(cache_mode == "Norm", f"unknown cache_mode {cache_mode!r}")
    for t, n in ((key, "key"), (value, "value"), (key_cache, "key_cache"),
                 (value_cache, "value_cache"), (slot_mapping, "slot_mapping")):
        _require(t.is_contiguous(), f"{n} must be contiguous")
    _require(key.dim() == 3 and value.dim() == 3, "key/value must be [T, N, D]")
    _require(key_cache.dim() == 4 and value_cache.dim() == 4,
             "Norm caches must be [num_blocks, block_size, N, D]")
    # The op scatters, it does not convert: key, value and caches of one dtype, int8 included
    # (§2.10).
    _require(
        key_cache.dtype in HALF + (torch.int8, ) and key.dtype == key_cache.dtype and
        value.dtype == value_cache.dtype == key_cache.dtype,
        f"fp16/bf16/int8 key/value and caches of one dtype (got {key.dtype}, {key_cache.dtype})")
    _require(key.shape[1:] == key_cache.shape[2:] and value.shape[1:] == value_cache.shape[2:],
             "key/value [T, N, D] must match the caches' [.., N, D]")
    _require(slot_mapping.dtype in (torch.int32, torch.int64),
             "slot_mapping must be int32 or int64")
    _require(slot_mapping.shape[0] == key.shape[0] == value.shape[0], "one slot per token")
    slots = _check_slots(slot_mapping, key_cache.shape[0] * key_cache.shape[1], "slot_mapping")
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value


def _reshape_and_cache(module, key, value, key_cache, value_cache, slot_indices):
    """ATB ReshapeAndCache [src]: key [T, Hkv, D] fp16/bf16/int8, caches [nb, bs, Hkv, D] ND,
    slot_indices int32."""
    if not module.atb:
        raise OSError("libop_plugin_atb.so: cannot open shared object file (NNAL/ATB not sourced)")
    _require(
        key.dim() == 3 and value.dim() == 3 and key_cache.dim() == 4 and value_cache.dim() == 4,
        "key/value [T, Hkv, D], caches [num_blocks, block_size, Hkv, D]")
    _require(
        key.dtype in HALF + (torch.int8, ) and
        key.dtype == value.dtype == key_cache.dtype == value_cache.dtype,
        "fp16/bf16/int8 key, value and caches of one dtype")
    _require(key.shape[1:] == key_cache.shape[2:] and value.shape[1:] == value_cache.shape[2:],
             "shape mismatch")
    _require(slot_indices.dtype == torch.int32, "slot_indices must be int32")
    _require(slot_indices.shape[0] == key.shape[0], "one slot per token")
    slots = _check_slots(slot_indices, key_cache.shape[0] * key_cache.shape[1], "slot_indices")
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value


# ---- §2.3 fused infer attention ----


def _fia_with_scale(module, query, key, value, *, pse_shift=None, atten_mask=None,
                    actual_seq_lengths=None, actual_seq_lengths_kv=None, antiquant_scale=None,
                    antiquant_offset=None, block_table=None, query_padding_size=None,
                    kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
                    value_antiquant_scale=None, value_antiquant_offset=None, query_rope=None,
                    key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                    pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                    antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0,
                    value_antiquant_mode=0):
    """The 7.x / torch_npu 2.14 signature (OPD:8053): the softmax scale is `scale`."""
    args = dict(locals())
    del args["module"]
    return _fia(module, **args)


def _fia_with_scale_value(module, query, key, value, *, pse_shift=None, atten_mask=None,
                          actual_seq_lengths=None, actual_seq_lengths_kv=None, antiquant_scale=None,
                          antiquant_offset=None, block_table=None, query_padding_size=None,
                          kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
                          value_antiquant_scale=None, value_antiquant_offset=None, query_rope=None,
                          key_rope=None, key_rope_antiquant_scale=None, num_heads=1,
                          scale_value=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX,
                          input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
                          block_size=0, antiquant_mode=0, softmax_lse_flag=False,
                          key_antiquant_mode=0, value_antiquant_mode=0):
    """The "Ascend Extension for PyTorch 6.0.x" signature (§0 version drift): the scale is
    `scale_value`."""
    args = dict(locals())
    del args["module"]
    args["scale"] = args.pop("scale_value")
    return _fia(module, **args)


FIA_OUT = "npu_fused_infer_attention_score.out"
WORKSPACE_OP = "_npu_fused_infer_attention_score_get_max_workspace"


def _fia_get_max_workspace(module, query, key, value, **kwargs):
    """OPD:8433: a workspace for FIA with these arguments, big enough for any lengths (what a graph
    task needs)."""
    # TypeError on a wrong keyword
    inspect.signature(module.fia_fn).bind(module, query, key, value, **kwargs)
    workspace = torch.empty(1024, dtype=torch.uint8)
    module.graph.workspaces.append(workspace)
    return workspace


def _fia_out(module, query, key, value, *, workspace=None, out=None, **kwargs):
    """OPD:8521: FIA writing attention_out and softmax_lse into out=[attention_out, softmax_lse]."""
    _require(
        isinstance(out, (list, tuple)) and len(out) == 2 and
        all(isinstance(t, torch.Tensor) for t in out), "out must be [attention_out, softmax_lse]")
    _require(workspace is None or any(workspace is w for w in module.graph.workspaces),
             "workspace must come from _npu_fused_infer_attention_score_get_max_workspace")
    o, lse = module.fia_fn(module, query, key, value, **kwargs)
    _require(
        out[0].shape == o.shape and out[0].dtype == o.dtype and out[0].is_contiguous(),
        f"attention_out must be a contiguous {o.dtype} {tuple(o.shape)}, got {out[0].dtype} "
        f"{tuple(out[0].shape)}"
    )
    _require(
        out[1].shape == lse.shape and out[1].dtype == torch.float32,
        f"softmax_lse must be float32 {tuple(lse.shape)}, got {out[1].dtype} {tuple(out[1].shape)}")
    out[0].copy_(o)
    out[1].copy_(lse)


def _split_queries(query, layout, num_heads, actual_seq_lengths):
    """Per-batch queries [Sq_b, N, D], the layout's Q_S and a writer putting per-batch outputs back
    in q's layout."""
    if layout == "TND":
        _require(query.dim() == 3 and query.shape[1] == num_heads,
                 "TND query must be [T, num_heads, D]")
        _require(actual_seq_lengths is not None,
                 "TND needs actual_seq_lengths (cumulative ends; its length is B)")
        ends = _host_ints(actual_seq_lengths, "actual_seq_lengths")
        _require(len(ends) > 0 and all(b >= a for a, b in zip([0] + ends, ends)),
                 "TND actual_seq_lengths must be non-decreasing cumulative end offsets")
        _require(
            ends[-1] == query.shape[0],
            f"TND q offsets must end at T={query.shape[0]}, got {ends[-1]} "
            "(error 561002 on the device)")
        starts = [0] + ends[:-1]
        qs = [query[a:b] for a, b in zip(starts, ends)]
        # Interpretation: in TND, Q_S (which picks IFA vs PFA) is the longest per-batch query.
        q_s = max(b - a for a, b in zip(starts, ends))

        def write(outs):
            return torch.cat(outs) if outs else query.new_zeros(query.shape)
        return qs, q_s, write
    if layout == "BSH":
        _require(query.dim() == 3 and query.shape[2] % num_heads == 0,
                 "BSH query must be [B, S, num_heads*D]")
        q4 = query.view(query.shape[0], query.shape[1], num_heads, -1)
    elif layout == "BSND":
        _require(query.dim() == 4 and query.shape[2] == num_heads,
                 "BSND query must be [B, S, num_heads, D]")
        q4 = query
    else:  # BNSD, BNSD_BSND
        _require(query.dim() == 4 and query.shape[1] == num_heads,
                 f"{layout} query must be [B, num_heads, S, D]")
        q4 = query.transpose(1, 2)
    batch, q_s = q4.shape[0], q4.shape[1]
    _require(layout != "BNSD_BSND" or q_s > 1, "BNSD_BSND is for Q_S > 1 only")
    lens = [q_s] * batch if actual_seq_lengths is None else _per_batch(actual_seq_lengths, batch,
                                                                       "actual_seq_lengths")
    _require(all(0 <= n <= q_s for n in lens), "actual_seq_lengths beyond the query's S")
    qs = [q4[b, :n] for b, n in enumerate(lens)]

    def write(outs):
        full = q4.new_zeros(*q4.shape[:3], outs[0].shape[-1] if outs else q4.shape[3])
        for b, o in enumerate(outs):
            full[b, :o.shape[0]] = o
        if layout == "BSH":
            return full.flatten(2)
        if layout == "BNSD":
            return full.transpose(1, 2).contiguous()
        return full  # BSND, and BNSD_BSND's BSND output
    return qs, q_s, write


def _paged_kv(module, key, value, layout, block_table, block_size, kv_lens, batch, num_kv, head_dim,
              ifa, antiquant=None):
    """§2.3 "PA" and §3 gather_kv: per-batch [L, Hkv, D] keys and values read through the block
    table. antiquant: int8 caches' (key, value) scales [num_blocks, Hkv, block_size] (§2.10 mode 5),
    applied to the rows read."""
    _require(layout != "TND" or module.tnd_paged,
             "TND does not support PA or prefix on A2/A3 (input_layout paragraph)")
    _require(
        block_table.dtype == torch.int32 and block_table.dim() == 2 and
        block_table.shape[0] == batch,
        f"block_table must be int32 [B={batch}, max_blocks], got {block_table.dtype} "
        f"{tuple(block_table.shape)}"
    )
    _require(kv_lens is not None, "a paged KV cache needs actual_seq_lengths_kv")
    if layout == "TND":  # per-batch kv lengths, not cumulative
        kv_lens = _host_ints(kv_lens, "actual_seq_lengths_kv")
        _require(
            len(kv_lens) == batch,
            f"TND + PA needs one kv length per batch ({batch}), got {len(kv_lens)}")
    else:
        kv_lens = _per_batch(kv_lens, batch, "actual_seq_lengths_kv")
    _require(key.shape == value.shape, "paged key and value caches must have one shape")
    if key.dim() == 3:  # (blocknum, blocksize, H)
        nb, bs, h = key.shape
        _require(h == num_kv * head_dim,
                 f"cache H={h} != num_key_value_heads*D={num_kv * head_dim}")
        _require(h <= 65535, "H = Hkv*D must be <= 65535 for the 3-D paged form (OPD:8220)")
        k4, v4 = key.view(nb, bs, num_kv, head_dim), value.view(nb, bs, num_kv, head_dim)
    else:  # (blocknum, KV_N, blocksize, D)
        _require(key.dim() == 4 and layout not in ("BSH", "BSND"),
                 "BSH/BSND queries take only the (blocknum, blocksize, H) cache")
        nb, _, bs, _ = key.shape
        _require(key.shape[1] == num_kv and key.shape[3] == head_dim,
                 "4-D cache must be (nb, Hkv, bs, D)")
        k4, v4 = key.transpose(1, 2), value.transpose(1, 2)
    _require(block_size == bs, f"block_size={block_size} but the cache's block size is {bs}")
    if ifa:
        align = 32 if key.dtype == torch.int8 else 16  # int8 key/value: 32-aligned blocks (§2.10)
        _require(
            bs % align == 0 and 0 < bs <= 512,
            f"Q_S == 1 with PA needs a {align}-aligned block size <= 512 for {key.dtype} "
            f"key/value, got {bs}"
        )
    else:
        _require(
            bs % 128 == 0 and 128 <= bs <= 512,
            "Q_S > 1 with PA needs a block size that is a multiple of 128 in [128, 512] "
            f"(OPD:8219), got {bs}"
        )
    _require(key.numel() < 2 ** 31, "cache shape product must fit in int32")
    ks, vs = [], []
    for b, n in enumerate(kv_lens):
        blocks = -(-n // bs)
        _require(
            blocks <= block_table.shape[1],
            f"batch {b}: kv length {n} needs {blocks} blocks, table has "
            f"{block_table.shape[1]}")
        ids = block_table[b, :blocks].long()
        # FIA never validates block ids (OPD:8218): on the device a bad id reads someone else's
        # memory.
        _require(bool(((ids >= 0) & (ids < nb)).all()),
                 f"batch {b}: block ids {ids.tolist()} outside [0, {nb})")
        k_rows, v_rows = k4[ids].reshape(-1, num_kv,
                                         head_dim)[:n], v4[ids].reshape(-1, num_kv,
                                                                        v4.shape[-1])[:n]
        if antiquant is not None:  # §3 antiquant: stored * the scale of its (block, head, offset)
            _require(
                antiquant[0].shape[0] == nb and antiquant[0].shape[2] == bs,
                f"per-token paged antiquant scales must be (blocknum={nb}, N={num_kv}, "
                f"blocksize={bs}), got "
                f"{tuple(antiquant[0].shape)}")
            k_rows, v_rows = ((rows.float() *
                               scale[ids].transpose(1, 2).reshape(-1, num_kv)[:n, :, None])
                              for rows, scale in zip((k_rows, v_rows), antiquant))
        ks.append(k_rows)
        vs.append(v_rows)
    return ks, vs


def _antiquant(module, key, value, layout, block_table, num_kv, args):
    """§2.10: int8 key/value need their dequantization scales, KV-separated
    (key_/value_antiquant_*). Emulated: mode 5, per token and KV head with the scales in pages of
    the cache, (blocknum, N, blocksize) float32, no offsets, a decode (Q_S == 1, checked by the
    caller) over a paged cache in a layout other than TND. Returns the (key, value) scales, or None
    for fp16/bf16 key/value (which take no antiquant arguments)."""
    given = {k: v for k, v in args.items() if (v is not None if not k.endswith("mode") else v != 0)}
    if key.dtype != torch.int8:
        _require(not given, f"{', '.join(sorted(given))}: antiquant arguments need int8 key/value")
        return None
    _require(value.dtype == torch.int8, "key and value must both be int8")
    if args["antiquant_scale"] is not None or args["antiquant_offset"] is not None:
        raise NotImplementedError(
            "the combined antiquant_scale/antiquant_offset (2, ...) are not emulated")
    k_scale, v_scale = args["key_antiquant_scale"], args["value_antiquant_scale"]
    _require(k_scale is not None and v_scale is not None,
             "int8 key/value need key_antiquant_scale and value_antiquant_scale (both or neither)")
    k_mode, v_mode = args["key_antiquant_mode"], args["value_antiquant_mode"]
    _require(k_mode == v_mode or (k_mode, v_mode) == (0, 1),
             f"key_antiquant_mode {k_mode} and value_antiquant_mode {v_mode} must match")
    _require(k_mode in range(6), f"key_antiquant_mode {k_mode} is not one of 0-5")
    if k_mode != 5:
        raise NotImplementedError(f"key_antiquant_mode {k_mode} is not emulated (5 only)")
    _require(
        module.paged_antiquant,
        "key_antiquant_mode 5 (per token and head, scales in pages) is not supported by "
        "this release")
    if args["key_antiquant_offset"] is not None or args["value_antiquant_offset"] is not None:
        raise NotImplementedError("antiquant offsets are not emulated")
    _require(
        block_table is not None,
        "antiquant mode 5 keeps its scales in pages: it needs the paged cache "
        "(block_table)")
    _require(layout != "TND",
             "TND takes no antiquant (the TND constraints of input_layout); use BSH/BSND/BNSD")
    for t, n in ((k_scale, "key_antiquant_scale"), (v_scale, "value_antiquant_scale")):
        _require(t.dtype == torch.float32, f"{n} must be float32 in mode 5, got {t.dtype}")
        _require(t.dim() == 3 and t.shape[1] == num_kv,
                 f"{n} must be (blocknum, N={num_kv}, blocksize), got "
                 f"{tuple(t.shape)}")
        _require(t.is_contiguous(), f"{n} is not contiguous (rejected)")
    _require(k_scale.shape == v_scale.shape, "key and value antiquant scales must have one shape")
    return k_scale, v_scale


def _dense_kv(key, value, layout, kv_lens, batch, num_kv):
    if layout == "TND":
        _require(
            key.dim() == 3 and key.shape[1] == num_kv and value.dim() == 3 and
            value.shape[1] == num_kv, "TND key/value must be [T, num_key_value_heads, D]")
        _require(kv_lens is not None, "TND needs actual_seq_lengths_kv (cumulative without PA)")
        ends = _host_ints(kv_lens, "actual_seq_lengths_kv")
        _require(
            len(ends) == batch and all(b >= a for a, b in zip([0] + ends, ends)) and
            ends[-1] <= key.shape[0],
            "TND kv lengths without PA must be B non-decreasing cumulative ends within the key's T")
        starts = [0] + ends[:-1]
        return [key[a:b] for a, b in zip(starts, ends)], [value[a:b] for a, b in zip(starts, ends)]
    if layout == "BSH":
        k4, v4 = key.view(key.shape[0], key.shape[1], num_kv,
                          -1), value.view(value.shape[0], value.shape[1], num_kv, -1)
    elif layout == "BSND":
        k4, v4 = key, value
    else:
        k4, v4 = key.transpose(1, 2), value.transpose(1, 2)
    _require(k4.shape[0] == batch and k4.shape[2] == num_kv,
             "key batch/heads do not match the query")
    lens = [k4.shape[1]] * batch if kv_lens is None else _per_batch(kv_lens, batch,
                                                                    "actual_seq_lengths_kv")
    return [k4[b, :n] for b, n in enumerate(lens)], [v4[b, :n] for b, n in enumerate(lens)]


def _fia(module, *, query, key, value, pse_shift, atten_mask, actual_seq_lengths,
         actual_seq_lengths_kv, antiquant_scale, antiquant_offset, block_table, query_padding_size,
         kv_padding_size, key_antiquant_scale, key_antiquant_offset, value_antiquant_scale,
         value_antiquant_offset, query_rope, key_rope, key_rope_antiquant_scale, num_heads, scale,
         pre_tokens, next_tokens, input_layout, num_key_value_heads, sparse_mode, inner_precise,
         block_size, antiquant_mode, softmax_lse_flag, key_antiquant_mode, value_antiquant_mode):
    for name, arg in (("pse_shift", pse_shift), ("query_padding_size", query_padding_size),
                      ("kv_padding_size", kv_padding_size), ("query_rope", query_rope),
                      ("key_rope", key_rope), ("key_rope_antiquant_scale",
                                               key_rope_antiquant_scale)):
        if arg is not None:
            raise NotImplementedError(f"{name} is not emulated")
    _require(input_layout in LAYOUTS, f"input_layout {input_layout!r} is not one of {LAYOUTS}")
    for t, n in ((query, "query"), (key, "key"), (value, "value")):
        _require(isinstance(t, torch.Tensor),
                 f"{n} must be a tensor (tensor lists are not supported)")
        _require(
            t.dtype in HALF or (n != "query" and t.dtype == torch.int8),
            f"{n} must be float16 or "
            f"bfloat16{'' if n == 'query' else ' (or int8 with antiquant)'}, got "
            f"{t.dtype}")
        _require(t.is_contiguous(), f"{n} is not contiguous (rejected)")
    _require(key.dtype == torch.int8 or query.dtype == key.dtype == value.dtype,
             "query, key and value must share a dtype")
    num_kv = num_key_value_heads or num_heads
    antiquant = _antiquant(
        module, key, value, input_layout, block_table, num_kv,
        dict(antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
             key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
             value_antiquant_scale=value_antiquant_scale,
             value_antiquant_offset=value_antiquant_offset, antiquant_mode=antiquant_mode,
             key_antiquant_mode=key_antiquant_mode, value_antiquant_mode=value_antiquant_mode))
    _require(
        num_heads >= 1 and num_heads % num_kv == 0 and num_heads // num_kv <= 64,
        f"num_heads={num_heads} must be a multiple of num_key_value_heads={num_kv}, ratio <= 64")
    if sparse_mode in (5, 6, 7, 8):
        raise FakeNpuError(f"sparse_mode {sparse_mode} is not implemented")
    _require(sparse_mode != 9, "sparse_mode 9 (tree mask) is MLA-only")
    _require(sparse_mode in (0, 1, 2, 3, 4), f"invalid sparse_mode {sparse_mode}")
    _require(inner_precise in (0, 1, 2, 3), f"invalid inner_precise {inner_precise}")
    _require(isinstance(scale, float) or isinstance(scale, int), "scale must be a Python number")

    qs, q_s, write = _split_queries(query, input_layout, num_heads, actual_seq_lengths)
    batch, head_dim = len(
        qs), query.shape[-1] if input_layout != "BSH" else query.shape[2] // num_heads
    # IFA (decode) kernel: sparse_mode and actual_seq_lengths are ignored (§2.3 "Branching")
    ifa = q_s == 1
    # Q_S > 1: "page attention does not support antiquant", and modes 2-5 are Q_S == 1 only (§2.10).
    _require(
        antiquant is None or ifa,
        "Q_S > 1 over a paged cache takes no antiquant (int8 key/value): PFA reads "
        "fp16/bf16 pages only")
    if block_table is not None:
        ks, vs = _paged_kv(module, key, value, input_layout, block_table, block_size,
                           actual_seq_lengths_kv, batch, num_kv, head_dim, ifa, antiquant)
    else:
        ks, vs = _dense_kv(key, value, input_layout, actual_seq_lengths_kv, batch, num_kv)

    if ifa:
        _require(inner_precise in (0, 1), "with Q_S == 1 only inner_precise 0/1 are allowed")
        if atten_mask is not None and sparse_mode == 0:
            raise NotImplementedError("decode masks [B, Skv] are not emulated")
    elif sparse_mode in (2, 3, 4):
        _require(atten_mask is not None,
                 f"sparse_mode {sparse_mode} needs the compressed 2048x2048 mask")
        _require(
            tuple(atten_mask.shape) in MASK_SHAPES,
            f"sparse_mode {sparse_mode} needs a (2048, 2048)-pattern mask, got "
            f"{tuple(atten_mask.shape)}"
        )
        _require(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8),
                 "atten_mask must be bool/int8/uint8")
        pattern = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=atten_mask.device),
                             diagonal=1)
        _require(
            torch.equal(atten_mask.reshape(2048, 2048).bool(), pattern),
            "the compressed mask must be the lower-triangular pattern: 1 (masked) strictly above "
            "the diagonal"
        )
    elif sparse_mode == 1 or atten_mask is not None:
        raise NotImplementedError(
            "explicit masks (sparse_mode 0/1 with atten_mask) are not emulated")
    elif pre_tokens != INT_MAX or next_tokens != INT_MAX:
        raise NotImplementedError("a pre/next_tokens band with sparse_mode 0 is not emulated")

    outs, lses = [], []
    for b, (qb, kb, vb) in enumerate(zip(qs, ks, vs)):
        sq, skv = qb.shape[0], kb.shape[0]
        if skv == 0 or sq == 0:  # empty KV returns zeros
            outs.append(torch.zeros(sq, num_heads, vb.shape[-1]))
            lses.append(torch.full((num_heads, sq), float("-inf")))
            continue
        i = torch.arange(sq)[:, None]
        j = torch.arange(skv)[None, :]
        off = skv - sq
        if ifa or sparse_mode == 0:
            allowed = torch.ones(sq, skv, dtype=torch.bool)
        elif sparse_mode == 2:
            allowed = j <= i
        elif sparse_mode == 3:
            allowed = j <= i + off
        else:
            allowed = (j >= i + off - pre_tokens) & (j <= i + off + next_tokens)
        o, lse = _attend(qb, kb, vb, scale, allowed)
        outs.append(o)
        lses.append(lse)
    out = write([o.to(query.dtype) for o in outs])
    if not softmax_lse_flag:
        return out, torch.zeros(1, dtype=torch.float32)
    if input_layout == "TND":
        lse = torch.cat([x.transpose(0, 1) for x in lses])[..., None]
    else:
        lse = torch.full((batch, num_heads, q_s, 1), float("-inf"))
        for b, x in enumerate(lses):
            lse[b, :, :x.shape[1], 0] = x
    return out, lse


# ---- §2.5 rotary, §2.6 norms, §2.7 SwiGLU ----

def _rotate(x, mode):
    if mode == "half":
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), -1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)


def _rotary_mul(module, input, r1, r2, rotary_mode="half", rotate=None):
    """OPD:3523: out-of-place x * r1 + rotate(x) * r2 with full-D r1/r2 broadcast over batch and
    heads."""
    _require(rotary_mode in ("half", "interleave"),
             f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    _require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4,
             "input, r1 and r2 must be 4-D (BNSD/BSND/SBND)")
    for t, n in ((input, "input"), (r1, "r1"), (r2, "r2")):
        _require(t.dtype in NORM_DTYPES, f"{n} must be fp16/bf16/fp32, got {t.dtype}")
    d = input.shape[-1]
    _require(d % 2 == 0 and d < 896, f"D must be even and < 896, got {d}")
    _require(
        r1.shape == r2.shape and r1.shape[-1] == d,
        f"r1/r2 must carry the full D={d} (halves duplicated), "
        f"got {tuple(r1.shape)} / {tuple(r2.shape)}")
    try:
        torch.broadcast_shapes(r1.shape, input.shape)
        _require(
            torch.broadcast_shapes(r1.shape, input.shape) == input.shape,
            "r1/r2 must broadcast to input")
    except RuntimeError as e:
        raise FakeNpuError(
            f"r1/r2 {tuple(r1.shape)} do not broadcast to input {tuple(input.shape)}") from e
    seq_axes = [a for a in range(3) if r1.shape[a] != 1]
    _require(
        len(seq_axes) <= 1,
        f"r1/r2 broadcast over batch and heads: only the S axis may be > 1, got "
        f"{tuple(r1.shape)}")
    if rotary_mode == "interleave":
        _require(len(seq_axes) == 1, "interleave mode accepts only the shapes 11SD, 1S1D and S11D")
    batch_head = [input.shape[a] for a in range(3) if a not in seq_axes]
    _require(all(n < 1000 for n in batch_head), f"B and N must be < 1000, got {batch_head}")
    for t, n in ((r1, "r1"), (r2, "r2")):
        _require(bool((t.float().abs() <= 1).all()), f"{n} values must lie in [-1, 1]")
    x = input.float()
    rotated = x @ rotate.float() if rotate is not None else _rotate(x, rotary_mode)
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


def _rms_core(x, gamma, epsilon):
    _require(x.dtype in NORM_DTYPES, f"x must be fp16/bf16/fp32, got {x.dtype}")
    _require(2 <= x.dim() <= 8, f"x must have 2-8 dims (torch_npu 2.14), got {x.dim()}")
    _require(gamma.dtype == x.dtype, f"gamma must have x's dtype ({x.dtype}), got {gamma.dtype}")
    g = gamma.dim()
    _require(1 <= g <= x.dim() and tuple(x.shape[-g:]) == tuple(gamma.shape),
             "gamma must cover x's trailing dims")
    dims = tuple(range(x.dim() - g, x.dim()))
    rstd = torch.rsqrt(x.float().pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x.float() * rstd * gamma.float()), rstd


def _rms_norm(module, self, gamma, epsilon=1e-06):
    """OPD:3439: (y, rstd) with rstd float32 of shape x.shape[:-g] + [1]*g."""
    y, rstd = _rms_core(self, gamma, epsilon)
    return y.to(self.dtype), rstd


def _add_rms_norm(module, x1, x2, gamma, epsilon=1e-06):
    """(y, rstd, x1 + x2): the sum, taken in float32, is normalized and returned in the input dtype
    (§2.6, §3)."""
    _require(x1.shape == x2.shape and x1.dtype == x2.dtype,
             "x1 and x2 must match in shape and dtype")
    s = x1.float() + x2.float()
    _require(gamma.dtype == x1.dtype, f"gamma must have x's dtype ({x1.dtype}), got {gamma.dtype}")
    y, rstd = _rms_core(s, gamma.float(), epsilon)
    return y.to(x1.dtype), rstd, s.to(x1.dtype)


def _swiglu(module, self, dim=-1):
    """OPD:4390: silu(first half) * second half along dim, computed in float32."""
    _require(self.dtype in NORM_DTYPES, f"x must be fp32/fp16/bf16, got {self.dtype}")
    _require(1 <= self.dim() <= 8, "x must have 1-8 dims")
    _require(self.shape[dim] % 2 == 0, f"dim {dim} has odd size {self.shape[dim]}")
    a, b = self.float().chunk(2, dim)
    return (a * torch.sigmoid(a) * b).to(self.dtype)


# ---- §2.11 grouped matmul ----

GMM_DTYPES = HALF + (torch.float32,)  # float32 only in the single-tensor form, the one emulated
INNER_LIMIT = 65536  # the inner (last) dims of x and weight
MAX_GROUPS = 1024  # group_type 0 with single tensors


def _weight_view(w, name):
    """A 3-D weight [E, K, N], contiguous or transposed in its last two dims (both documented): (w,
    transposed)."""
    _require(w.dim() == 3,
             f"{name} must be 3-D [E, K, N] for group_type 0 with one tensor, got {w.dim()}-D")
    e, kk, n = w.shape
    transposed = w.stride() == (kk * n, 1, kk) and not w.is_contiguous()
    _require(
        w.is_contiguous() or transposed,
        f"{name} must be contiguous or transposed in its last two dims, got "
        f"strides {w.stride()}")
    return w, transposed


def _grouped_matmul(module, x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                    antiquant_offset=None, per_token_scale=None, group_list=None,
                    activation_input=None, activation_quant_scale=None,
                    activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0,
                    act_type=0, output_dtype=None, tuning_config=None):
    """The single-tensor form ("single-single-single", group_type 0), which the MoE and LoRA ops
    call: y[rows of group g] = x[rows] @ weight[g]."""
    _require(
        isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)),
        "x and weight are lists of tensors")
    if len(x) != 1 or len(weight) != 1 or group_type != 0:
        raise NotImplementedError(
            "only one x, one 3-D weight and group_type=0 (split M) are emulated")
    if any(v is not None for v in (bias, scale, offset, antiquant_scale, antiquant_offset,
                                   per_token_scale, activation_input, activation_quant_scale,
                                   activation_quant_offset)) or act_type:
        raise NotImplementedError("bias, quantization and fused activations are not emulated")
    a, (w, transposed) = x[0], _weight_view(weight[0], "weight[0]")
    _require(split_item in (2, 3),
             "group_type 0 with single tensors needs split_item 2 or 3 (one output)")
    _require(
        a.dim() == 2 and a.is_contiguous(),
        f"x[0] must be a contiguous 2-D tensor (x is not transposable), got "
        f"{tuple(a.shape)} strides {a.stride()}")
    _require(
        a.dtype in GMM_DTYPES and w.dtype == a.dtype,
        f"x and weight must be one of fp16/bf16/fp32, same "
        f"dtype; got {a.dtype}, {w.dtype}")
    _require(output_dtype in (None, a.dtype), f"output_dtype {output_dtype} for {a.dtype} inputs")
    _require(a.shape[1] == w.shape[1],
             f"x [M, K={a.shape[1]}] does not fit weight [E, K={w.shape[1]}, N]")
    # The inner (last) dim of x is K; of the weight N, or K when it is transposed.
    _require(a.shape[1] < INNER_LIMIT and w.shape[1 if transposed else 2] < INNER_LIMIT,
             "inner dims must be < 65536")
    _require(
        isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and
        group_list.dim() == 1, "group_list must be a 1-D int64 tensor")
    _require(
        group_list.numel() == w.shape[0] <= MAX_GROUPS,
        f"group_list has {group_list.numel()} groups for "
        f"{w.shape[0]} weights (at most {MAX_GROUPS})")
    _require(group_list_type in (0, 1),
             "group_list_type 0 (cumsum) or 1 (counts); 2 is for int8 only")
    _require(group_list_type == 0 or group_list.numel() != 1,
             "group_list_type 1: the counts' length cannot be 1")
    sizes = group_list if group_list_type == 1 else torch.diff(group_list,
                                                               prepend=group_list.new_zeros(1))
    _require(bool((sizes >= 0).all()),
             "group_list must be non-negative (and non-decreasing as a cumsum)")
    _require(
        int(sizes.sum()) == a.shape[0],
        f"the group sizes add up to {int(sizes.sum())}, x has {a.shape[0]} "
        "rows: they must be equal")
    out = torch.empty(a.shape[0], w.shape[2], dtype=a.dtype)
    start = 0
    for g, size in enumerate(sizes.tolist()):
        out[start:start + size] = (a[start:start + size].float() @ w[g].float()).to(a.dtype)
        start += size
    return [out]


# ---- graph mode: torch.npu.NPUGraph, task groups and their updates, ExternalEvent (§5.1, §5.4)
# ----  Interpretations, where §5.4 says what to do but not what the device enforces: a task group
# holds the one attention call, issued as FIA's .out with a workspace from _get_max_workspace; a
# re-issue uses the captured tensors and may change host arguments only; an update runs on a
# non-default stream outside any capture. The emulation runs everything in issue order, so a task's
# update (and its ExternalEvent record) must be issued before the replay reaches it; on the device
# the event lets an update issued after the replay start still come first. Captured ops also run
# once at capture here (the device only records them); nothing may rely on their values then.

# Ops whose result depends on tensor values on the host: a capture cannot hold them.
DATA_DEPENDENT = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
                  "aten::unique_consecutive", "aten::repeat_interleave"}
EMPTY = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
    "aten::new_empty_strided"
}


def _tensors(x):
    """Tensors in x, in order: a tensor, or lists, tuples and dicts of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _snapshot(x):
    """What a graph task keeps of an argument: tensors by reference (device memory), host values by
    value."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_snapshot(v) for v in x)
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    return x  # ints, floats, strings, dtypes, None: immutable


def _storage(t):
    return t.untyped_storage().data_ptr()


class _AtenTask:
    """A recorded aten op. Replay re-executes it on the same tensors; a fresh output's new values
    are copied into the tensor the capture returned (its static address). Views alias their input
    and need nothing; `empty` allocates memory and runs nothing."""

    def __init__(self, func, args, kwargs, result):
        self.func, self.args, self.kwargs = func, args, kwargs
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        outputs = _tensors(result)
        self.copy = [(i, o) for i, o in enumerate(outputs)
                     if o.numel() and _storage(o) not in inputs]
        mutates = any(a.alias_info is not None and a.alias_info.is_write
                      for a in func._schema.arguments)
        self.runs = func._schema.name not in EMPTY and (mutates or bool(self.copy))

    def replay(self):
        if self.runs:
            new = _tensors(self.func(*self.args, **self.kwargs))
            for i, o in self.copy:
                o.copy_(new[i])


class _OpTask:
    """A torch_npu op: one device task, run at replay with its captured (or re-issued) arguments."""

    def __init__(self, module, name, fn, args, kwargs, result):
        self.module, self.name, self.fn = module, name, fn
        self.args, self.kwargs = _snapshot(args), _snapshot(kwargs)
        self.outputs = _tensors(result)

    def replay(self):
        new = _tensors(self.fn(self.module, *self.args, **self.kwargs))
        for o, n in zip(self.outputs, new):
            o.copy_(n)
        self.module.graph.replayed[self.name] += 1


class _EventTask:
    def __init__(self, event, action):
        self.event, self.action = event, action

    def replay(self):
        getattr(self.event, self.action)()


class _Recorder(TorchDispatchMode):
    """Records the aten ops of a capture outside torch_npu ops (those record themselves, as one task
    each)."""

    def __init__(self, state, graph):
        super().__init__()
        self.state, self.graph = state, graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.state.op_depth:  # inside an emulated torch_npu op: part of its kernel
            return func(*args, **kwargs)
        name = func._schema.name  # without the overload
        if any("Tensor" not in str(r.type) for r in func._schema.returns):
            raise FakeNpuError(
                f"{name} returns a host value during graph capture: a device->host sync")
        # repeat_interleave with an int repeats (self_int, what inference mode dispatches for
        # x.repeat_interleave(2)) has a static shape; its tensor-repeats overloads do not.
        static = name == "aten::repeat_interleave" and func._overloadname == "self_int"
        if (name in DATA_DEPENDENT and
                not static) or (name in ("aten::index", "aten::index_put_", "aten::index_put") and
                                any(t.dtype in (torch.bool, torch.uint8)
                                    for t in _tensors(args[1]))):
            raise FakeNpuError(f"{name} has a data-dependent output shape: it cannot be captured")
        result = func(*args, **kwargs)
        self.state.check_not_in_group(name)
        self.graph.tasks.append(_AtenTask(func, args, kwargs, result))
        return result


class TaskGroup:
    """graph_task_group_end's handle: the one torch_npu task captured between group begin and end.
    """

    def __init__(self, graph, task):
        self.graph, self.task = graph, task


class FakeStream:
    def __init__(self, device=None, priority=0, default=False):
        self.default = default

    def wait_stream(self, other):
        pass  # the emulation runs everything in issue order

    def synchronize(self):
        pass


class GraphState:
    """Where the emulation stands: the graph being captured, an open task group or update, the
    current stream."""

    def __init__(self):
        self.capturing = None
        self.op_depth = 0
        self.group = None  # index of the open task group's first task in the capturing graph
        self.updating = None  # (handle, re-issued calls) between graph_task_update_begin/end
        self.default_stream = self.current_stream = FakeStream(default=True)
        self.workspaces = []
        self.updates = collections.Counter()  # op -> tasks updated
        self.replayed = collections.Counter()  # op -> tasks replayed

    def record_op(self, name, fn, module, args, kwargs):
        self.op_depth += 1
        try:
            result = fn(module, *args, **kwargs)
        finally:
            self.op_depth -= 1
        if name == WORKSPACE_OP:
            return result  # sizes and allocates memory on the host: no device task
        if self.group is not None:
            tasks = self.capturing.tasks
            _require(
                len(tasks) == self.group,
                "a task group holds one attention task; it already has one")
            _require(
                name == FIA_OUT and kwargs.get("workspace") is not None,
                "an updatable attention task is FIA's .out form with a workspace from "
                f"{WORKSPACE_OP} (§5.4), "
                f"got {name}")
        self.capturing.tasks.append(_OpTask(module, name, fn, args, kwargs, result))
        return result

    def check_not_in_group(self, name):
        _require(self.group is None,
                 f"{name} issued inside a task group: a group holds the attention task only")

    def reissue(self, name, args, kwargs):
        handle, issued = self.updating
        task = handle.task
        _require(name == task.name, f"the update of a {task.name} task re-issued {name}")
        old, new = _tensors((task.args, task.kwargs)), _tensors((args, kwargs))
        same = len(old) == len(new) and all(a.data_ptr() == b.data_ptr() and a.shape == b.shape and
                                            a.stride() == b.stride() and a.dtype == b.dtype
                                            for a, b in zip(old, new))
        _require(
            same,
            "a re-issued task must use the captured tensors (the graph's memory); only host "
            "arguments "
            "may change")
        issued.append((_snapshot(args), _snapshot(kwargs)))


def _graph_api(state):
    """The torch.npu names the ACL graph path uses: NPUGraph, graph(), streams, ExternalEvent, task
    groups."""

    def require_stream(stream, what):
        _require(stream is state.current_stream, f"{what} takes the current stream")

    class NPUGraph:
        def __init__(self):
            self.tasks = []
            self.captured = False
            self.replays = 0
            self._pool = object()

        def capture_begin(self, pool=None):
            _require(state.capturing is None, "a capture is already running")
            if pool is not None:
                self._pool = pool
            self.tasks = []
            state.capturing = self

        def capture_end(self):
            _require(state.capturing is self, "capture_end without capture_begin")
            _require(state.group is None, "capture ended inside a task group")
            state.capturing = None
            self.captured = True

        def pool(self):
            return self._pool

        def replay(self):
            _require(self.captured, "replay of a graph that was not captured")
            _require(state.capturing is None and state.updating is None,
                     "replay during a capture or an update")
            for task in self.tasks:
                task.replay()
            self.replays += 1

    def tolist_outside_capture(original):
        def tolist(self):
            if state.capturing is not None and not state.op_depth:
                raise FakeNpuError(".tolist() during graph capture: a device->host sync")
            return original(self)
        return tolist

    @contextlib.contextmanager
    def graph(npu_graph, pool=None, stream=None, capture_error_mode=None):
        previous = state.current_stream
        state.current_stream = stream or FakeStream()  # captures run on a side stream
        npu_graph.capture_begin(pool)
        own = torch.Tensor.__dict__.get("tolist")  # normally inherited from torch._C.TensorBase
        torch.Tensor.tolist = tolist_outside_capture(torch.Tensor.tolist)
        try:
            with _Recorder(state, npu_graph):
                yield npu_graph
        finally:
            if own is None:
                del torch.Tensor.tolist
            else:
                torch.Tensor.tolist = own
            state.group = None
            if state.capturing is npu_graph:
                npu_graph.capture_end()
            state.current_stream = previous

    @contextlib.contextmanager
    def stream(s):
        previous, state.current_stream = state.current_stream, s
        try:
            yield s
        finally:
            state.current_stream = previous

    def synchronize(device=None):
        _require(state.capturing is None, "synchronize() during graph capture")

    class ExternalEvent:
        """Captured wait/reset become graph tasks; a record outside a capture marks the event. A
        replayed wait on an event nobody recorded would block the device forever: here it raises."""

        def __init__(self):
            self.recorded = False

        def _issue(self, action, stream):
            if state.capturing is not None:
                require_stream(stream, f"ExternalEvent.{action} in a capture")
                state.check_not_in_group(f"ExternalEvent.{action}")
                state.capturing.tasks.append(_EventTask(self, "_" + action))
            else:
                getattr(self, "_" + action)()

        def record(self, stream=None):
            self._issue("record", stream)

        def wait(self, stream=None):
            self._issue("wait", stream)

        def reset(self, stream=None):
            self._issue("reset", stream)

        def _record(self):
            self.recorded = True

        def _wait(self):
            _require(
                self.recorded,
                "waiting on an ExternalEvent that was never recorded (the device would hang): "
                "the attention task's update did not run")

        def _reset(self):
            self.recorded = False

    def graph_task_group_begin(stream):
        _require(state.capturing is not None, "graph_task_group_begin outside a capture")
        require_stream(stream, "graph_task_group_begin")
        _require(state.group is None, "task groups do not nest")
        state.group = len(state.capturing.tasks)

    def graph_task_group_end(stream):
        _require(state.group is not None, "graph_task_group_end without graph_task_group_begin")
        require_stream(stream, "graph_task_group_end")
        tasks = state.capturing.tasks[state.group:]
        state.group = None
        _require(len(tasks) == 1 and isinstance(tasks[0], _OpTask), "an empty task group")
        return TaskGroup(state.capturing, tasks[0])

    def graph_task_update_begin(stream, handle):
        _require(state.capturing is None, "task updates run outside a capture")
        _require(state.updating is None, "an update is already open")
        _require(
            isinstance(handle, TaskGroup) and handle.graph.captured,
            "not a handle of a captured task group")
        require_stream(stream, "graph_task_update_begin")
        _require(not stream.default,
                 "task updates run on an update stream, not the default one (§5.4)")
        state.updating = (handle, [])

    def graph_task_update_end(stream):
        _require(state.updating is not None,
                 "graph_task_update_end without graph_task_update_begin")
        require_stream(stream, "graph_task_update_end")
        handle, issued = state.updating
        state.updating = None
        _require(
            len(issued) == 1, f"an update re-issues the group's one task, got {len(issued)} calls")
        handle.task.args, handle.task.kwargs = issued[0]
        state.updates[handle.task.name] += 1

    return dict(NPUGraph=NPUGraph, graph=graph, Stream=FakeStream, stream=stream,
                current_stream=lambda device=None: state.current_stream,
                default_stream=lambda device=None: state.default_stream, synchronize=synchronize,
                ExternalEvent=ExternalEvent, graph_task_group_begin=graph_task_group_begin,
                graph_task_group_end=graph_task_group_end,
                graph_task_update_begin=graph_task_update_begin,
                graph_task_update_end=graph_task_update_end)


# ---- installing it ----

def install(monkeypatch, **variant) -> FakeTorchNpu:
    """Put a fake torch_npu into sys.modules (and torch.npu, reporting no device) and force
    VLINFER_OPS=npu; monkeypatch undoes these when the test ends. An NpuOps keeps the torch_npu it
    was made with: one made after another install() runs on the newer fake, the older one on its
    own."""
    fake = FakeTorchNpu(**variant)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    # Importing torch_npu registers torch.npu; platform.npu_available() asks it for a device. There
    # is none: the engine stays on CPU tensors and only the op implementation is the NPU one.
    api = _graph_api(fake.graph) if fake.graphs else {}
    monkeypatch.setattr(
        torch, "npu",
        types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0, **api),
        raising=False)
    monkeypatch.setenv("VLINFER_OPS", "npu")
    return fake


@pytest.fixture
def fake_npu(monkeypatch):
    """The emulated torch_npu of torch_npu 2.14 (scale keyword `scale`, scatter op present, TND + PA
    accepted)."""
    return install(monkeypatch)


def loaded(monkeypatch, **variant):
    """install(), then select the op table as an engine on CPU tensors does at start-up: (the fake,
    its NpuOps)."""
    from vlinfer.ops.select import select
    from vlinfer.ops.npu import NpuOps
    fake = install(monkeypatch, **variant)
    ops = select("cpu")
    assert type(ops) is NpuOps and ops._torch_npu is fake
    return fake, ops
