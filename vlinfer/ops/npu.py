"""Ascend NPU implementation of every op in reference.py, on torch_npu's fused operators.

Written against the operator contracts in docs/npu-ops.md (section numbers below refer to it); nothing here has
run on an NPU yet, tests/fake_torch_npu.py emulates those contracts on CPU. torch_npu is imported when an NpuOps is
made, not at module import: it cannot import without the CANN runtime.

- KV cache: per layer [num_blocks, block_size, kv_heads, head_dim], contiguous (§1). The cache write takes it 4-D;
  attention takes .view(num_blocks, block_size, kv_heads * head_dim), FIA's "(blocknum, blocksize, H)" paged form:
  the same memory, no copy. Block size must be 128 for prefill (§1, OPD:8219); platform.py defaults to it.
- Attention: one npu_fused_infer_attention_score (FIA v1) call per layer in TND layout for any mix of prefill
  chunks, prefix hits and decodes, bottom-right causal (sparse_mode 3), as vllm-ascend HEAD does (§5.3, §7.2). The
  docs disagree on whether TND supports a paged KV cache (§2.3 "TND caveat"), so NpuOps probes it on the device;
  without it, decodes and prefills run as two FIA calls in BSH layout.
- FIA's actual_seq_lengths are host int lists (SymInt[], §1). They are built once per step from the
  ForwardContext tensors and reused by every layer: each .tolist() is a device->host sync.
- float32: FIA and the cache writes take fp16/bf16 only (§1), so with a float32 model those ops run the pure-torch
  reference (on the NPU), with a warning at first use. Norms, rotary and SwiGLU take float32.
- Graph mode (ACL graphs, vlinfer/engine/acl_graph.py): while a decode graph is captured (`NpuOps.capturing`),
  nothing here may sync with the host, and each layer's attention is captured as a task group that every replay
  re-issues with that step's host lengths (§5.4); see "graph mode" below.
- State: torch_npu, what loading detected, warnings, masks, per-step caches and the graph being captured belong to
  one NpuOps instance (one per engine); this module keeps none.
"""
import logging
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from vlinfer.ops import npu_graph, npu_moe, npu_quant, reference
from vlinfer.ops.npu_graph import AttentionTask, GraphCapture
from vlinfer.ops.npu_host import (AttentionMeta, SplitPlan, causal_mask, detect_cache_write, detect_fia_scale_kwarg,
                                  paged_kv, segment_ends, valid_slots)
from vlinfer.ops.per_step import PerStep
from vlinfer.ops.reference import ReferenceOps

logger = logging.getLogger("vlinfer")
NAME = "npu"

HALF_DTYPES = (torch.float16, torch.bfloat16)


class NpuOps(ReferenceOps):
    """The NPU op table of one engine: every op but linear and the GELU (one aclnn op each already) on torch_npu.
    The loaded torch_npu, what loading detected, warnings given, causal masks, per-step host metadata and the decode
    graph being captured are this instance's."""
    name = NAME

    def __init__(self, device_type: str = "npu"):
        """Import torch_npu, detect what this release offers and probe it on the device. Raises when unusable."""
        import torch_npu
        super().__init__(device_type)
        self._torch_npu = torch_npu
        # What loading found: "fia_scale_kwarg" ("scale" or "scale_value", None until the first call decides),
        # "cache_write" (the op name) and "tnd_paged" (whether one TND call may read the paged cache).
        self.features: dict = {}
        self._warned: set = set()  # ops whose float32 fallback was logged, once per engine
        self._masks: dict = {}  # device -> the int8 causal mask
        # Host metadata derived once per step from the ForwardContext tensors (see PerStep).
        self._slots_step, self._attention_step, self._varlen_step, self._rotary_step = (PerStep(), PerStep(),
                                                                                         PerStep(), PerStep())
        self._capture: GraphCapture | None = None  # the decode graph being captured (`capturing`)
        self.features["fia_scale_kwarg"] = detect_fia_scale_kwarg(torch_npu)
        self.features["cache_write"] = detect_cache_write(torch_npu)
        self.features["tnd_paged"] = self._probe(torch.device(device_type))
        self._slots_step.reset()  # drop the probe's slots
        logger.info("ops[npu]: cache write %s, FIA scale keyword %r, attention %s", self.features["cache_write"],
                    self.features["fia_scale_kwarg"],
                    "one TND call per layer" if self.features["tnd_paged"]
                    else "split: BSH decode call + BSH prefill call")

    def _probe(self, device: torch.device) -> bool:
        """Write a tiny fp16 cache with the detected op (surfacing a missing NNAL/ATB library now, not mid-request),
        then run one mixed TND + paged FIA call and compare it with the reference. Returns whether TND + paged
        works."""
        g = torch.Generator().manual_seed(0)
        bs, num_heads, num_kv_heads, head_dim = 128, 2, 1, 64
        # A chunk of 3 after a cached prefix of 127 (its KV crosses a block edge) and a decode at length 5.
        q_lens, kv_lens, tables = [3, 1], [130, 5], torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
        slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                           for i, n in enumerate(kv_lens)]).to(device)
        tables = tables.to(device)
        k_cache = torch.zeros(3, bs, num_kv_heads, head_dim, dtype=torch.float16, device=device)
        v_cache = torch.zeros_like(k_cache)
        keys = torch.randn(len(slots), num_kv_heads, head_dim, generator=g).to(device, torch.float16)
        values = torch.randn(len(slots), num_kv_heads, head_dim, generator=g).to(device, torch.float16)
        try:
            self.store_kvcache(keys, values, k_cache, v_cache, slots)
        except TypeError as e:
            if self.features["cache_write"] != "npu_scatter_pa_kv_cache" or "cache_mode" not in str(e):
                raise
            logger.warning("ops[npu]: npu_scatter_pa_kv_cache rejected cache_mode (%s); using "
                           "_npu_reshape_and_cache", e)
            self.features["cache_write"] = "_npu_reshape_and_cache"
            self.store_kvcache(keys, values, k_cache, v_cache, slots)
        expected = torch.zeros_like(k_cache)
        expected.view(-1, num_kv_heads, head_dim)[slots] = keys
        if not torch.equal(k_cache, expected):
            raise RuntimeError(f"{self.features['cache_write']} did not write the KV cache at the given slots")

        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(device, torch.float16)
        cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
        seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, 0.125)
        try:
            out = self._tnd_paged_attention(q, k_cache, v_cache, AttentionMeta(cu, seq_lens, tables), 0.125)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        except Exception as e:  # the doc's "TND does not support PA" (§2.3) on this CANN
            logger.warning("ops[npu]: FIA in TND layout over the paged cache failed (%s: %s); splitting decode and "
                           "prefill into BSH calls", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            return False
        if not err < 1e-2:
            logger.warning("ops[npu]: FIA in TND layout over the paged cache is off by %.3g; splitting decode and "
                           "prefill into BSH calls", err)
            return False
        return True

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        if device not in self._masks:
            self._masks[device] = causal_mask(device)
        return self._masks[device]

    def _warn_fallback(self, op: str, dtype: torch.dtype) -> None:
        if op not in self._warned:
            self._warned.add(op)
            logger.warning("ops[npu]: %s on %s runs the pure-torch reference: the torch_npu kernel takes float16 or "
                           "bfloat16 only (npu-ops.md §1)", op, dtype)

    def _fia(self, query, key, value, scale: float, **kwargs) -> torch.Tensor:
        """npu_fused_infer_attention_score's attention output, passing the scale under this release's keyword."""
        fia = self._torch_npu.npu_fused_infer_attention_score
        kw = self.features.get("fia_scale_kwarg")
        if kw is not None:
            return fia(query, key, value, **{kw: scale}, **kwargs)[0]
        try:
            out = fia(query, key, value, scale=scale, **kwargs)[0]
            kw = "scale"
        except TypeError as e:
            if "scale" not in str(e):
                raise
            out = fia(query, key, value, scale_value=scale, **kwargs)[0]
            kw = "scale_value"
        self.features["fia_scale_kwarg"] = kw
        logger.info("ops[npu]: FIA takes the softmax scale as %r (found by trying)", kw)
        return out

    # ---- KV cache write ----

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if k_cache.dtype not in HALF_DTYPES:
            self._warn_fallback("store_kvcache", k_cache.dtype)
            self._no_fallback_in_capture("store_kvcache", k_cache.dtype)
            return reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        if self._capture is not None:  # graph padding writes to reserved slots, never -1 (GraphRunner): no sync
            slots, keep = slot_mapping.to(torch.int32), None
        else:
            slots, keep = self._slots_step.get(valid_slots, slot_mapping)
        if keep is not None:
            key, value = key[keep], value[keep]
        # The scatter op needs contiguous inputs (§2.1); v is a strided view of the fused qkv projection.
        key = key.to(k_cache.dtype).contiguous()
        value = value.to(v_cache.dtype).contiguous()
        if self.features["cache_write"] == "npu_scatter_pa_kv_cache":
            # "Norm" is required for ND caches [num_blocks, block_size, kv_heads, head_dim]; the default 'PA_NZ'
            # expects the NZ layout [num_blocks, kv_heads*head_dim/16, block_size, 16] (§2.1).
            self._torch_npu.npu_scatter_pa_kv_cache(key, value, k_cache, v_cache, slots, cache_mode="Norm")
        else:
            self._torch_npu._npu_reshape_and_cache(key, value, k_cache, v_cache, slots)

    # ---- paged attention ----

    def paged_attention(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
        if q.dtype not in HALF_DTYPES or k_cache.dtype not in HALF_DTYPES:
            self._warn_fallback("paged_attention", k_cache.dtype)
            self._no_fallback_in_capture("paged_attention", k_cache.dtype)
            return reference.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)
        if self._capture is not None:
            return self._captured_decode_attention(q.contiguous(), k_cache, v_cache, block_tables, scale)
        meta = self._attention_step.get(AttentionMeta, cu_seqlens_q, seq_lens, block_tables)
        block_size = k_cache.shape[1]
        # FIA's paged limits (§2.3 "PA"): decode-only (IFA) needs 16-aligned <= 512; any multi-token query (PFA)
        # needs a multiple of 128 in [128, 512]. Say so here rather than let the kernel fail with an error code.
        if meta.max_q_len > 1 and (block_size % 128 or not 128 <= block_size <= 512):
            raise ValueError(f"NPU prefill attention needs kvcache_block_size to be a multiple of 128 in [128, 512] "
                             f"(FIA with a paged cache, npu-ops.md §2.3); got {block_size}")
        if block_size % 16 or block_size > 512:
            raise ValueError(f"NPU decode attention needs kvcache_block_size 16-aligned and <= 512; got {block_size}")
        q = q.contiguous()
        if self.features["tnd_paged"]:
            return self._tnd_paged_attention(q, k_cache, v_cache, meta, scale)
        return self._split_paged_attention(q, k_cache, v_cache, meta, scale)

    def _tnd_paged_attention(self, q, k_cache, v_cache, meta: "AttentionMeta", scale):
        """One call for the whole batch: q [T, heads, D] packed, each sequence's queries its last tokens. A decode is
        a 1-token chunk, which bottom-right causal lets see its whole context; a decode-only batch runs the IFA
        kernel, which ignores the mask and sparse mode (§2.3 "Branching")."""
        k, v = paged_kv(k_cache, v_cache)
        return self._fia(q, k, v, scale, atten_mask=self._causal_mask(q.device), actual_seq_lengths=meta.q_ends,
                         actual_seq_lengths_kv=meta.kv_lens, block_table=meta.block_table, num_heads=q.shape[1],
                         num_key_value_heads=k_cache.shape[2], input_layout="TND", sparse_mode=3,
                         block_size=k_cache.shape[1])

    def _split_paged_attention(self, q, k_cache, v_cache, meta: "AttentionMeta", scale):
        """Without TND over the paged cache: a BSH decode call (IFA) and a BSH call over the zero-padded prefill
        chunks (PFA, bottom-right causal per sequence from actual_seq_lengths); BSH takes the 3-D cache (§2.3
        "PA")."""
        if meta.split is None:
            meta.split = SplitPlan(meta, q.device)
        plan = meta.split
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        k, v = paged_kv(k_cache, v_cache)
        out = torch.empty_like(q)
        common = dict(num_heads=num_heads, num_key_value_heads=num_kv_heads, input_layout="BSH",
                      block_size=block_size)
        if plan.decode:
            qd = q[plan.decode_tokens].view(len(plan.decode), 1, num_heads * head_dim)
            o = self._fia(qd, k, v, scale, actual_seq_lengths_kv=[meta.kv_lens[i] for i in plan.decode],
                          block_table=plan.decode_table, **common)
            out[plan.decode_tokens] = o.view(-1, num_heads, head_dim)
        if plan.prefill:
            qp = q.new_zeros(len(plan.prefill) * plan.max_s, num_heads, head_dim)
            qp[plan.dst] = q[plan.src]
            o = self._fia(qp.view(len(plan.prefill), plan.max_s, num_heads * head_dim), k, v, scale,
                          atten_mask=self._causal_mask(q.device),
                          actual_seq_lengths=[meta.q_lens[i] for i in plan.prefill],
                          actual_seq_lengths_kv=[meta.kv_lens[i] for i in plan.prefill],
                          block_table=plan.prefill_table, sparse_mode=3, **common)
            out[plan.src] = o.view(-1, num_heads, head_dim)[plan.dst]
        return out

    # ---- graph mode: decode attention as updatable ACL graph tasks (§5.4) ----

    @contextmanager
    def capturing(self, capture: "GraphCapture"):
        """Route these ops' decode paths to their graph forms while a decode graph is being captured."""
        if self._capture is not None:
            raise RuntimeError("a decode graph is already being captured with these ops")
        self._capture = capture
        try:
            yield capture
        finally:
            self._capture = None

    def graph_features(self) -> list[str]:
        return npu_graph.missing_graph_features(self._torch_npu)

    def _no_fallback_in_capture(self, op: str, dtype: torch.dtype) -> None:
        if self._capture is not None:
            raise RuntimeError(f"{op} on {dtype} runs the pure-torch reference, which reads lengths on the host: it "
                               "cannot be captured in a graph (the torch_npu kernel takes float16 or bfloat16 only)")

    def _decode_call(self, q, k_cache, v_cache, block_table, q_ends, kv_lens):
        """FIA's (query, key, value), keywords and output buffer for a decode-only batch: the eager call's layout,
        TND (one call per layer) or BSH (the split path's decode call, every row a decode)."""
        num_tokens, num_heads, head_dim = q.shape
        k, v = paged_kv(k_cache, v_cache)
        common = dict(actual_seq_lengths_kv=kv_lens, block_table=block_table, num_heads=num_heads,
                      num_key_value_heads=k_cache.shape[2], block_size=k_cache.shape[1])
        if self.features["tnd_paged"]:
            return (q, k, v), dict(atten_mask=self._causal_mask(q.device), actual_seq_lengths=q_ends,
                                   input_layout="TND", sparse_mode=3, **common), torch.empty_like(q)
        q = q.view(num_tokens, 1, num_heads * head_dim)
        return (q, k, v), dict(input_layout="BSH", **common), torch.empty_like(q)

    def _captured_decode_attention(self, q, k_cache, v_cache, block_tables, scale):
        """Capture one layer's decode attention as its own task group (§5.1, §5.4): FIA's tiling comes from the host
        lengths, which the graph would otherwise replay as captured. The .out form writes a preallocated output with
        a workspace sized for any lengths (_get_max_workspace), so a re-issue at replay reuses the same memory.
        Before the group, the task waits on an ExternalEvent that the replay's update records, then resets it for
        the next replay."""
        cap, torch_npu = self._capture, self._torch_npu
        if q.shape[0] != len(cap.kv_lens):
            raise RuntimeError(f"a captured decode graph has one token per row: {q.shape[0]} tokens, "
                               f"{len(cap.kv_lens)} rows")
        block_table = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
        args, kwargs, out = self._decode_call(q, k_cache, v_cache, block_table.contiguous(), cap.q_ends,
                                              cap.kv_lens)
        kwargs[self.features.get("fia_scale_kwarg") or "scale"] = scale
        workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(*args, **kwargs)
        lse = torch.empty(1, dtype=torch.float32, device=q.device)  # softmax_lse without the flag: a [1] zero (§2.3)
        stream = torch.npu.current_stream()
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(*args, workspace=workspace, out=[out, lse], **kwargs)
        handle = torch.npu.graph_task_group_end(stream)
        cap.tasks.append(AttentionTask(handle, event, args, kwargs, workspace, out, lse))
        return out.view(q.shape)

    def update_graph_attention(self, capture: "GraphCapture", kv_lens: list[int], stream) -> None:
        npu_graph.update_graph_attention(self._torch_npu, capture, kv_lens, stream)

    # ---- vision tower attention ----

    def varlen_attention(self, q, k, v, cu_seqlens, scale):
        """Bidirectional attention per packed segment: FIA in TND layout with cumulative q and kv lengths, no block
        table, sparse_mode 0 and no mask (§5.5, §7.5)."""
        if q.dtype not in HALF_DTYPES:
            self._warn_fallback("varlen_attention", q.dtype)
            return reference.varlen_attention(q, k, v, cu_seqlens, scale)
        ends = self._varlen_step.get(segment_ends, cu_seqlens)
        num_heads, head_dim = q.shape[1], q.shape[2]
        # vllm-ascend zero-pads 64 < D < 128 (e.g. 72 for a 1152-wide, 16-head tower) to 128 before FIA (§5.5):
        # zero columns add nothing to q.k, and the zero value columns are cut off the output; the scale stays
        # 1/sqrt(D).
        pad = 128 - head_dim if 64 < head_dim < 128 else 0
        if pad:
            q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
        out = self._fia(q.contiguous(), k.contiguous(), v.contiguous(), scale, actual_seq_lengths=ends,
                        actual_seq_lengths_kv=ends, num_heads=num_heads, num_key_value_heads=num_heads,
                        input_layout="TND", sparse_mode=0)
        return out[..., :head_dim] if pad else out

    # ---- rotary, norms, activation ----

    def _rotary_tables(self, cos, sin):
        """npu_rotary_mul's r1/r2: full-D cos/sin as [1, T, 1, D] for BSND input, float32 like the reference.

        r1/r2 must lie in [-1, 1] (§2.5), but tables carrying an attention scaling > 1 (yarn, longrope) exceed it.
        Then the tables are divided and the input multiplied by the same power of two, which is exact in floating
        point. Checking the range costs one sync, once per step (every layer passes the same cos/sin). A captured
        graph cannot sync: there the power of two is computed and applied on the device, whatever the tables
        hold."""
        r1 = cos.float()[None, :, None, :].contiguous()
        r2 = sin.float()[None, :, None, :].contiguous()
        if self._capture is not None:
            peak = torch.maximum(r1.abs().amax(), r2.abs().amax()).clamp(min=1.0)
            factor = torch.exp2(torch.ceil(torch.log2(peak)))
            return r1 / factor, r2 / factor, factor
        peak = torch.maximum(r1.abs().amax(), r2.abs().amax()).item() if r1.numel() else 0.0
        if peak <= 1.0:
            return r1, r2, 1.0
        factor = 2.0 ** math.ceil(math.log2(peak))
        return r1 / factor, r2 / factor, factor

    def apply_rotary(self, q, k, cos, sin):
        """Neox rotary (rotary_mode 'half' = rotate_half) on q [T, heads, D] and k [T, kv_heads, D] with one
        npu_rotary_mul call over both, in float32 as the reference rotates."""
        r1, r2, factor = self._rotary_step.get(self._rotary_tables, cos, sin)
        num_q = q.shape[1]
        x = torch.cat((q, k), 1).float()[None]  # [1, T, heads + kv_heads, D]: BSND
        if isinstance(factor, torch.Tensor) or factor != 1.0:
            x.mul_(factor)
        out = self._torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode="half")[0]
        return out[:, :num_q].to(q.dtype), out[:, num_q:].to(k.dtype)

    def rms_norm(self, x, weight, eps):
        # gamma must have x's dtype (§2.6); the model keeps both in the model dtype, so this cast is normally a
        # no-op.
        return self._torch_npu.npu_rms_norm(x, weight.to(x.dtype), eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        # Returns (y, rstd, x1 + x2); the sum becomes the new residual (§2.6).
        y, _, residual = self._torch_npu.npu_add_rms_norm(x, residual, weight.to(x.dtype), eps)
        return y, residual

    def silu_and_mul(self, x):
        # silu(first half) * second half along the last dim, i.e. SiluAndMul on the merged gate_up projection
        # (§2.7).
        return self._torch_npu.npu_swiglu(x, -1)

    # ---- fused MoE: gating top-k softmax, init routing v2, grouped matmuls, finalize (npu_moe.py) ----

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize, expert_offset=0):
        return npu_moe.fused_moe(self._torch_npu, x, router_logits, w13, w2, top_k, renormalize, expert_offset)

    def pack_moe_weights(self, w13, w2):
        return None  # the grouped matmuls take w13 / w2 as transposed views of the loaded layout

    # ---- quantized linears: the calls vllm-ascend makes (npu_quant.py) ----

    def pack_quantized_linear(self, scheme, tensors):
        return npu_quant.pack(scheme, tensors)

    def w8a8_dynamic_linear(self, x, packed, bias=None):
        return npu_quant.w8a8_dynamic_linear(self, x, packed, bias)

    def w8a8_static_linear(self, x, packed, bias=None):
        return npu_quant.w8a8_static_linear(self, x, packed, bias)

    def weight_only_linear(self, x, packed, bias=None):
        return npu_quant.weight_only_linear(self, x, packed, bias)
