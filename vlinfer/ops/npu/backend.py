"""`NpuOps`: the Ascend NPU implementation of the ops (ops/interface.py), on torch_npu's fused
operators.

Written against the operator contracts in docs/npu-ops.md (section numbers below refer to it);
nothing here has run on an NPU yet, tests/fakes/fake_torch_npu.py emulates those contracts on CPU.
torch_npu is imported when an NpuOps is made, not at module import: it cannot import without the
CANN runtime.

- KV cache: per layer [num_blocks, block_size, kv_heads, head_dim], contiguous (§1). The cache write
  takes it 4-D;
  attention takes .view(num_blocks, block_size, kv_heads * head_dim), FIA's "(blocknum, blocksize,
  H)" paged form:
  the same memory, no copy. Block size must be 128 for prefill (§1, OPD:8219); default_block_size
  gives it.
- Attention: one npu_fused_infer_attention_score (FIA v1) call per layer in TND layout for any mix
  of prefill
  chunks, prefix hits and decodes, bottom-right causal (sparse_mode 3), as vllm-ascend HEAD does
  (§5.3, §7.2). The
  docs disagree on whether TND supports a paged KV cache (§2.3 "TND caveat"), so NpuOps probes it on
  the device;
  without it, decodes and prefills run as two FIA calls in BSH layout.
- FIA's actual_seq_lengths are host int lists (SymInt[], §1). They are built once per step from the
  ForwardContext tensors and reused by every layer: each .tolist() is a device->host sync.
- float32: FIA and the cache writes take fp16/bf16 only (§1), so with a float32 model those ops run
  the pure-torch
  reference (on the NPU), with a warning at first use. Norms, rotary and SwiGLU take float32.
- int8 KV caches (kv_cache_dtype="int8", a static int8 / C8 checkpoint; §2.10, §7.7):
  npu_dynamic_quant + the cache
  scatter write them, FIA antiquant mode 5 reads decodes, prefill chunks read their blocks back;
  checked against the
  reference on first use (kv_cache.py).
- Graph mode (ACL graphs, graph.py): while a decode graph is captured (`NpuOps._capturing`),
  nothing here may sync with the host, and each layer's attention is captured as a task group that
  every replay
  re-issues with that step's host lengths (§5.4); see "graph mode" below and graph.py.
- One file per op family behind the NpuOps methods: host.py (feature detection, per-step host
  metadata, the shared paged FIA call shapes), kv_cache.py, graph.py, quant.py, moe.py, lora.py
  (LoRA on npu_grouped_matmul), linear_attention.py (hybrid models' Gated DeltaNet; the recurrent
  state pool stored value-major, as those ops read it).
- State: torch_npu, what loading detected, warnings, masks, per-step caches and the graph being
  captured belong to
  one NpuOps instance (one per engine); this module keeps none.
"""
import logging
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from vlinfer.ops import reference
from vlinfer.ops.interface import PerStep
from vlinfer.ops.npu import graph as npu_graph
from vlinfer.ops.npu import kv_cache as npu_kv_cache
from vlinfer.ops.npu import linear_attention as npu_linear_attention
from vlinfer.ops.npu import lora as npu_lora
from vlinfer.ops.npu import moe as npu_moe
from vlinfer.ops.npu import quant as npu_quant
from vlinfer.ops.npu.graph import GraphCapture
from vlinfer.ops.npu.host import (HALF_DTYPES, HALF_ONLY, AttentionMeta, SplitPlan, bsh_decode_args,
                                  causal_mask, detect_cache_write, detect_fia_scale_kwarg, paged_kv,
                                  segment_ends, valid_slots)
from vlinfer.ops.reference import ReferenceOps
from vlinfer.ops.reference import kv_cache as kv_quant_reference

logger = logging.getLogger("vlinfer")
NAME = "npu"
NPU_BLOCK_SIZE = 128


class NpuOps(ReferenceOps):
    """The NPU op table of one engine: every op but linear and the GELU (one aclnn op each already),
    the causal conv1d and the gated RMSNorm (no torch_npu op fits: the reference) on torch_npu.
    The loaded torch_npu, what loading detected, warnings given, causal masks, per-step host
    metadata and the decode graph being captured are this instance's."""
    name = NAME

    def __init__(self, device_type: str = "npu"):
        """Import torch_npu, detect what this release offers and probe it on the device. Raises when
        unusable."""
        import torch_npu
        super().__init__(device_type)
        self._torch_npu = torch_npu
        # What loading found: "fia_scale_kwarg" ("scale" or "scale_value", None until the first call
        # decides), "cache_write" (the op name), "tnd_paged" (whether one TND call may read the
        # paged cache) and, once an int8 KV cache is first asked about, "int8_kv" (whether this
        # torch_npu writes and reads it as the reference).
        self.features: dict = {}
        # (op, dtype) whose reference fallback was logged, once per engine
        self._warned: set = set()
        self._masks: dict = {}  # device -> the int8 causal mask
        # Host metadata derived once per step from the ForwardContext tensors (see PerStep).
        self._slots_step, self._attention_step, self._varlen_step, self._rotary_step = (PerStep(),
                                                                                        PerStep(),
                                                                                        PerStep(),
                                                                                        PerStep())
        self._state_step = PerStep()  # a decode step's slots that start from zeros
        self._capture: GraphCapture | None = None  # the decode graph being captured (`_capturing`)
        self.features["fia_scale_kwarg"] = detect_fia_scale_kwarg(torch_npu)
        self.features["cache_write"] = detect_cache_write(torch_npu)
        self.features["tnd_paged"] = self._probe(torch.device(device_type))
        self._slots_step.reset()  # drop the probe's slots
        logger.info(
            "ops[npu]: cache write %s, FIA scale keyword %r, attention %s",
            self.features["cache_write"], self.features["fia_scale_kwarg"], "one TND call per layer"
            if self.features["tnd_paged"] else "split: BSH decode call + BSH prefill call")

    # ---- the block-size rule: FIA's paged limits ----

    @classmethod
    def default_block_size(cls, device_type: str) -> int:
        # The only block size every torch_npu paged attention path accepts (§1).
        return NPU_BLOCK_SIZE if device_type == "npu" else super().default_block_size(device_type)

    def check_block_size(self, block_size: int, multi_token: bool, decode_align: int = 16) -> None:
        """FIA's paged limits (§2.3 "PA", §2.10): decode-only (IFA) needs blocks
        decode_align-aligned (16 for fp16/bf16 pages, 32 for int8) and <= 512; any multi-token query
        (PFA) a multiple of 128 in [128, 512]. Said here rather than left to the kernel's error
        code."""
        if multi_token and (block_size % 128 or not 128 <= block_size <= 512):
            raise ValueError(f"NPU prefill attention needs kvcache_block_size to be a multiple of "
                             f"128 in [128, 512] (FIA with a paged cache, npu-ops.md §2.3); got "
                             f"{block_size}")
        if block_size % decode_align or block_size > 512:
            raise ValueError(f"NPU decode attention needs kvcache_block_size "
                             f"{decode_align}-aligned and <= 512; got {block_size}")

    def _probe(self, device: torch.device) -> bool:
        """Write a tiny fp16 cache with the detected op (surfacing a missing NNAL/ATB library now,
        not mid-request), then run one mixed TND + paged FIA call and compare it with the reference.
        Returns whether TND + paged works."""
        g = torch.Generator().manual_seed(0)
        bs, num_heads, num_kv_heads, head_dim = 128, 2, 1, 64
        # A chunk of 3 after a cached prefix of 127 (its KV crosses a block edge) and a decode at
        # length 5.
        q_lens, kv_lens, tables = [3, 1], [130, 5], torch.tensor([[2, 0], [1, -1]],
                                                                 dtype=torch.int32)
        slots = torch.cat([tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                           for i, n in enumerate(kv_lens)]).to(device)
        tables = tables.to(device)
        k_cache = torch.zeros(3, bs, num_kv_heads, head_dim, dtype=torch.float16, device=device)
        v_cache = torch.zeros_like(k_cache)
        keys = torch.randn(len(slots), num_kv_heads, head_dim,
                           generator=g).to(device, torch.float16)
        values = torch.randn(len(slots), num_kv_heads, head_dim,
                             generator=g).to(device, torch.float16)
        try:
            self.store_kvcache(keys, values, k_cache, v_cache, slots)
        except TypeError as e:
            if self.features["cache_write"] != "npu_scatter_pa_kv_cache" or "cache_mode" not in str(
                    e):
                raise
            logger.warning("ops[npu]: npu_scatter_pa_kv_cache rejected cache_mode (%s); using "
                           "_npu_reshape_and_cache", e)
            self.features["cache_write"] = "_npu_reshape_and_cache"
            self.store_kvcache(keys, values, k_cache, v_cache, slots)
        expected = torch.zeros_like(k_cache)
        expected.view(-1, num_kv_heads, head_dim)[slots] = keys
        if not torch.equal(k_cache, expected):
            raise RuntimeError(
                f"{self.features['cache_write']} did not write the KV cache at the given slots")

        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(device, torch.float16)
        cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
        seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
        ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens,
                                        tables, 0.125)
        try:
            out = self._tnd_paged_attention(q, k_cache, v_cache,
                                            AttentionMeta(cu, seq_lens, tables), 0.125)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        except Exception as e:  # the doc's "TND does not support PA" (§2.3) on this CANN
            logger.warning(
                "ops[npu]: FIA in TND layout over the paged cache failed (%s: %s); splitting "
                "decode and "
                "prefill into BSH calls",
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "")
            return False
        if not err < 1e-2:
            logger.warning(
                "ops[npu]: FIA in TND layout over the paged cache is off by %.3g; splitting decode "
                "and "
                "prefill into BSH calls", err)
            return False
        return True

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        if device not in self._masks:
            self._masks[device] = causal_mask(device)
        return self._masks[device]

    def _warn_fallback(self, op: str, dtype: torch.dtype, why: str = HALF_ONLY) -> None:
        if (op, dtype) not in self._warned:
            self._warned.add((op, dtype))
            logger.warning("ops[npu]: %s on %s runs the pure-torch reference: %s", op, dtype, why)

    def _fia(self, query, key, value, scale: float, **kwargs) -> torch.Tensor:
        """npu_fused_infer_attention_score's attention output, passing the scale under this
        release's keyword."""
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
        # fp16/bf16 caches; an int8 cache takes rows quantized already (a static int8 checkpoint's,
        # layers/attention.py)
        int8_rows = k_cache.dtype == torch.int8 and key.dtype == torch.int8
        if k_cache.dtype not in HALF_DTYPES and not int8_rows:
            self._warn_fallback("store_kvcache", k_cache.dtype)
            self._no_fallback_in_capture("store_kvcache", k_cache.dtype)
            return reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        if int8_rows and not npu_kv_cache.int8_kv(self):
            return npu_kv_cache.int8_fallback(self, "store_kvcache", reference.store_kvcache, key,
                                              value, k_cache, v_cache, slot_mapping)
        slots, keep = self._slots(slot_mapping)
        if keep is not None:
            key, value = key[keep], value[keep]
        # The scatter op needs contiguous inputs (§2.1); v is a strided view of the fused qkv
        # projection.
        self._write_rows(
            key.to(k_cache.dtype).contiguous(),
            value.to(v_cache.dtype).contiguous(), k_cache, v_cache, slots)

    def _slots(self, slot_mapping):
        """(int32 slots, the rows to keep or None): negative (padding) slots dropped, which reads
        the mask on the host once per step; a captured graph's padding writes to reserved slots,
        never -1 (GraphRunner): no sync."""
        if self._capture is not None:
            return slot_mapping.to(torch.int32), None
        return self._slots_step.get(valid_slots, slot_mapping)

    def _write_rows(self, key, value, k_cache, v_cache, slots) -> None:
        """Scatter contiguous rows [T, kv_heads, head_dim] of the caches' dtype into their slots
        (§2.1, §7.1)."""
        if self.features["cache_write"] == "npu_scatter_pa_kv_cache":
            # "Norm" is required for ND caches [num_blocks, block_size, kv_heads, head_dim]; the
            # default 'PA_NZ' expects the NZ layout [num_blocks, kv_heads*head_dim/16, block_size,
            # 16] (§2.1).
            self._torch_npu.npu_scatter_pa_kv_cache(key, value, k_cache, v_cache, slots,
                                                    cache_mode="Norm")
        else:
            self._torch_npu._npu_reshape_and_cache(key, value, k_cache, v_cache, slots)

    # ---- paged attention ----

    def paged_attention(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
        if q.dtype not in HALF_DTYPES or k_cache.dtype not in HALF_DTYPES:
            self._warn_fallback("paged_attention", k_cache.dtype)
            self._no_fallback_in_capture("paged_attention", k_cache.dtype)
            return reference.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens,
                                             block_tables, scale)
        if self._capture is not None:
            return npu_graph.captured_decode_attention(self, q.contiguous(), k_cache, v_cache,
                                                       block_tables, scale)
        meta = self._attention_step.get(AttentionMeta, cu_seqlens_q, seq_lens, block_tables)
        self.check_block_size(k_cache.shape[1], meta.max_q_len > 1, 16)
        q = q.contiguous()
        if self.features["tnd_paged"]:
            return self._tnd_paged_attention(q, k_cache, v_cache, meta, scale)
        return self._split_paged_attention(q, k_cache, v_cache, meta, scale)

    def _tnd_paged_attention(self, q, k_cache, v_cache, meta: "AttentionMeta", scale):
        """One call for the whole batch: q [T, heads, D] packed, each sequence's queries its last
        tokens. A decode is a 1-token chunk, which bottom-right causal lets see its whole context; a
        decode-only batch runs the IFA kernel, which ignores the mask and sparse mode (§2.3
        "Branching")."""
        k, v = paged_kv(k_cache, v_cache)
        return self._fia(q, k, v, scale, atten_mask=self._causal_mask(q.device),
                         actual_seq_lengths=meta.q_ends, actual_seq_lengths_kv=meta.kv_lens,
                         block_table=meta.block_table, num_heads=q.shape[1],
                         num_key_value_heads=k_cache.shape[2], input_layout="TND", sparse_mode=3,
                         block_size=k_cache.shape[1])

    def _split_paged_attention(self, q, k_cache, v_cache, meta: "AttentionMeta", scale,
                               int8_scales=None):
        """Without TND over the paged cache, or over an int8 cache (int8_scales: its row scales): a
        BSH decode call (IFA; over int8 pages in antiquant mode 5) and a BSH call over the
        zero-padded prefill chunks (PFA, bottom-right causal per sequence from actual_seq_lengths;
        an int8 cache's blocks read back in q's dtype first, since PFA takes no antiquant over a
        paged cache, §2.10). BSH takes the 3-D cache (§2.3 "PA")."""
        if meta.split is None:
            meta.split = SplitPlan(meta, q.device)
        plan = meta.split
        num_heads, head_dim = q.shape[1], q.shape[2]
        out = torch.empty_like(q)
        if plan.decode:
            args, kwargs = bsh_decode_args(
                q[plan.decode_tokens], k_cache, v_cache, plan.decode_table,
                [meta.kv_lens[i] for i in plan.decode],
                npu_kv_cache.antiquant(*int8_scales) if int8_scales is not None else None)
            out[plan.decode_tokens] = self._fia(*args, scale,
                                                **kwargs).view(-1, num_heads, head_dim)
        if plan.prefill:
            table = plan.prefill_table
            if int8_scales is not None:
                k_cache, v_cache, table = kv_quant_reference.dequantized_blocks(
                    k_cache, v_cache, *int8_scales, table, q.dtype)
            k, v = paged_kv(k_cache, v_cache)
            qp = q.new_zeros(len(plan.prefill) * plan.max_s, num_heads, head_dim)
            qp[plan.dst] = q[plan.src]
            o = self._fia(qp.view(len(plan.prefill), plan.max_s, num_heads * head_dim), k, v, scale,
                          atten_mask=self._causal_mask(q.device),
                          actual_seq_lengths=[meta.q_lens[i] for i in plan.prefill],
                          actual_seq_lengths_kv=[meta.kv_lens[i]
                                                 for i in plan.prefill], block_table=table,
                          num_heads=num_heads, num_key_value_heads=k_cache.shape[2],
                          input_layout="BSH", sparse_mode=3, block_size=k_cache.shape[1])
            out[plan.src] = o.view(-1, num_heads, head_dim)[plan.dst]
        return out

    # ---- int8 KV caches: npu_dynamic_quant + the cache scatter, FIA antiquant mode 5 (kv_cache.py,
    # §7.7) ----

    @property
    def kv_cache_kernels(self) -> tuple:
        # FIA reads int8 pages (antiquant) only: no fp8 KV on Atlas A2/A3, and half pages must be
        # q's dtype (§2.10).
        return (torch.int8,) if npu_kv_cache.int8_kv(self) else ()

    def int8_kv_scales(self, shape: tuple, device) -> torch.Tensor:
        return npu_kv_cache.int8_kv_scales(shape, device)

    def store_quantized_kvcache(self, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        npu_kv_cache.store_quantized_kvcache(self, key, value, k_cache, v_cache, k_scale, v_scale,
                                             slot_mapping)

    def quantized_paged_attention(self, q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q,
                                  seq_lens, block_tables, scale):
        return npu_kv_cache.quantized_paged_attention(self, q, k_cache, v_cache, k_scale, v_scale,
                                                      cu_seqlens_q, seq_lens, block_tables, scale)

    # ---- graph mode: decode attention as updatable ACL graph tasks (§5.4; captured and updated in
    # graph.py) ----

    def graph_capture(self, device: torch.device):
        if device.type != "npu":
            return super().graph_capture(device)
        return npu_graph.backend(device, self)

    @contextmanager
    def _capturing(self, capture: "GraphCapture"):
        """Route these ops' decode paths to their graph forms while a decode graph is being
        captured."""
        if self._capture is not None:
            raise RuntimeError("a decode graph is already being captured with these ops")
        self._capture = capture
        try:
            yield capture
        finally:
            self._capture = None

    def _update_graph_attention(self, capture: "GraphCapture", kv_lens: list[int], stream) -> None:
        npu_graph.update_graph_attention(self._torch_npu, capture, kv_lens, stream)

    def _no_fallback_in_capture(self, op: str, dtype: torch.dtype, why: str = HALF_ONLY) -> None:
        if self._capture is not None:
            raise RuntimeError(
                f"{op} on {dtype} runs the pure-torch reference, which reads lengths on the host: "
                "it "
                f"cannot be captured in a graph ({why})")

    # ---- vision tower attention ----

    def varlen_attention(self, q, k, v, cu_seqlens, scale):
        """Bidirectional attention per packed segment: FIA in TND layout with cumulative q and kv
        lengths, no block table, sparse_mode 0 and no mask (§5.5, §7.5)."""
        if q.dtype not in HALF_DTYPES:
            self._warn_fallback("varlen_attention", q.dtype)
            return reference.varlen_attention(q, k, v, cu_seqlens, scale)
        ends = self._varlen_step.get(segment_ends, cu_seqlens)
        num_heads, head_dim = q.shape[1], q.shape[2]
        # vllm-ascend zero-pads 64 < D < 128 (e.g. 72 for a 1152-wide, 16-head tower) to 128 before
        # FIA (§5.5): zero columns add nothing to q.k, and the zero value columns are cut off the
        # output; the scale stays 1/sqrt(D).
        pad = 128 - head_dim if 64 < head_dim < 128 else 0
        if pad:
            q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
        out = self._fia(q.contiguous(), k.contiguous(), v.contiguous(), scale,
                        actual_seq_lengths=ends, actual_seq_lengths_kv=ends, num_heads=num_heads,
                        num_key_value_heads=num_heads, input_layout="TND", sparse_mode=0)
        return out[..., :head_dim] if pad else out

    # ---- rotary, norms, activation ----

    def _rotary_tables(self, cos, sin):
        """npu_rotary_mul's r1/r2: full-D cos/sin as [1, T, 1, D] for BSND input, float32 like the
        reference.

        r1/r2 must lie in [-1, 1] (§2.5), but tables carrying an attention scaling > 1 (yarn,
        longrope) exceed it. Then the tables are divided and the input multiplied by the same power
        of two, which is exact in floating point. Checking the range costs one sync, once per step
        (every layer passes the same cos/sin). A captured graph cannot sync: there the power of two
        is computed and applied on the device, whatever the tables hold."""
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
        """Neox rotary (rotary_mode 'half' = rotate_half) on q [T, heads, D] and k [T, kv_heads, D]
        with one npu_rotary_mul call over both, in float32 as the reference rotates."""
        r1, r2, factor = self._rotary_step.get(self._rotary_tables, cos, sin)
        num_q = q.shape[1]
        x = torch.cat((q, k), 1).float()[None]  # [1, T, heads + kv_heads, D]: BSND
        if isinstance(factor, torch.Tensor) or factor != 1.0:
            x.mul_(factor)
        out = self._torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode="half")[0]
        return out[:, :num_q].to(q.dtype), out[:, num_q:].to(k.dtype)

    def rms_norm(self, x, weight, eps):
        # gamma must have x's dtype (§2.6); the model keeps both in the model dtype, so this cast is
        # normally a no-op.
        return self._torch_npu.npu_rms_norm(x, weight.to(x.dtype), eps)[0]

    def add_rms_norm(self, x, residual, weight, eps):
        # Returns (y, rstd, x1 + x2); the sum becomes the new residual (§2.6).
        y, _, residual = self._torch_npu.npu_add_rms_norm(x, residual, weight.to(x.dtype), eps)
        return y, residual

    def silu_and_mul(self, x):
        # silu(first half) * second half along the last dim, i.e. SiluAndMul on the merged gate_up
        # projection (§2.7).
        return self._torch_npu.npu_swiglu(x, -1)

    # ---- linear attention of hybrid models: torch_npu's Gated DeltaNet ops (linear_attention.py,
    # §2.12 - §2.14) ----

    state_cache_kernels = npu_linear_attention.STATE_KERNEL_DTYPES

    def recurrent_state_pool(self, shape, dtype, device):
        return npu_linear_attention.state_pool(shape, dtype, device)

    def state_graph_refusal(self, state_dtype):
        return npu_linear_attention.GRAPH_REFUSAL

    def gated_delta_rule(self, q, k, v, g, beta, state, cu_seqlens, slots, has_state, scale):
        return npu_linear_attention.gated_delta_rule(self, q, k, v, g, beta, state, cu_seqlens,
                                                     slots, has_state, scale)

    def causal_conv1d(self, x, weight, bias, conv_state, cu_seqlens, slots, has_state):
        return npu_linear_attention.causal_conv1d(self, x, weight, bias, conv_state, cu_seqlens,
                                                  slots, has_state)

    # ---- fused MoE: gating top-k softmax, init routing v2, grouped matmuls, finalize (moe.py) ----

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize, expert_offset=0):
        return npu_moe.fused_moe(self._torch_npu, x, router_logits, w13, w2, top_k, renormalize,
                                 expert_offset)

    def add_lora(self, x, y, lora_a, lora_b, groups, packed=None):
        return npu_lora.add_lora(self._torch_npu, x, y, lora_a, lora_b, groups)  # §7.8

    def pack_moe_weights(self, w13, w2):
        return None  # the grouped matmuls take w13 / w2 as transposed views of the loaded layout

    # ---- quantized linears: the calls vllm-ascend makes (quant.py) ----

    def pack_quantized_linear(self, scheme, tensors):
        return npu_quant.pack(scheme, tensors)

    def w8a8_dynamic_linear(self, x, packed, bias=None):
        return npu_quant.w8a8_dynamic_linear(self, x, packed, bias)

    def w8a8_static_linear(self, x, packed, bias=None):
        return npu_quant.w8a8_static_linear(self, x, packed, bias)

    def weight_only_linear(self, x, packed, bias=None):
        return npu_quant.weight_only_linear(self, x, packed, bias)
