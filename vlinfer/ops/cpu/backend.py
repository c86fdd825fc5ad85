"""`CpuOps`: our compiled CPU kernels (csrc/), prebuilt in the wheel or JIT-compiled at first use
(loader.py); every projection on a packed weight (ours or oneDNN's). Decode attention, the cache
write, rotary, the norms, SiLU-and-multiply and tanh GELU run the kernels; the norms and activations
are memory-bound passes the reference spreads over several tensor ops each. The op families' code is
in this package's files: attention.py, kv_cache.py, linear.py (panels.py: the panel layout), moe.py,
quant.py, gguf.py, lora.py, linear_attention.py (hybrid models' linear attention).

Which code the kernels run is chosen from the CPU the engine runs on, at load time
(cpu_features.cpu_isa): the sources are compiled once per instruction-set level (generic x86-64,
AVX2, AVX-512, AVX-512 with BF16), each into its own extension name, so a kernel cache built for one
CPU is never loaded on a CPU that lacks its instructions (torch's cache is keyed by name).
`CpuOps(isa=...)` builds a lower level on purpose: tests run the generic path and every level the
test machine supports.

Attention in bfloat16 on CPUs with AVX512-BF16 (prefill chunks, decode, the vision tower) runs our
vdpbf16ps kernels, which outrun torch's SDPA CPU kernel there without AMX. In float32, prefill and
vision attention stay on torch's flash kernel (SDPA), which is exact against transformers; a prefill
chunk over a cached context runs it twice, merged by log-sum-exp (attention.py). Matmuls are
oneDNN's: it uses AMX where the CPU has it, so we write no AMX code of our own.

Linear layers (linear.py): `pack_linear_weight` converts a projection's weight once into our
32-output panels (csrc/panel_linear.cpp) or oneDNN's blocked layout, which the layer keeps instead
of its parameter; both beat F.linear's per-call re-layout (bench/linear_rates.py re-derives it;
figures in docs/benchmarks.md "Kernel decisions"). Decode steps of a dense model whose projections
are all on panels run every decoder layer in one call (`dense_decode_stack`, csrc/decode_layer.cpp):
the same kernels, without the modules' Python between them."""
import logging

import torch

from vlinfer.ops import reference
from vlinfer.ops.cpu import (attention, gguf, int8_panels, kv_cache, linear, linear_attention,
                             lora, moe, quant)
from vlinfer.ops.cpu.loader import ISA_FLAGS, build_extension
from vlinfer.ops.interface import PerStep
from vlinfer.ops.reference import ReferenceOps, bitmask
from vlinfer.ops.reference import gguf as gguf_reference
from vlinfer.platform import cpu_features

logger = logging.getLogger("vlinfer")


class CpuOps(ReferenceOps):
    name = "cpu-compiled"

    def __init__(self, device_type: str = "cpu", isa: str | None = None,
                 bf16_prefill_kernels: bool | None = None):
        """isa: the instruction-set level to build and run; None takes the best this CPU has. Asking
        for a level the CPU lacks raises (its code would die on an illegal instruction).
        bf16_prefill_kernels: run our bf16 prefill and vision attention kernels (True), SDPA
        (False), or decide from the CPU (None; see below)."""
        super().__init__(device_type)
        best = cpu_features.cpu_isa()
        self.isa = isa or best
        if self.isa not in ISA_FLAGS:
            raise ValueError(
                f"unknown CPU kernel level {self.isa!r}; expected one of {', '.join(ISA_FLAGS)}")
        if cpu_features.CPU_ISAS.index(self.isa) > cpu_features.CPU_ISAS.index(best):
            raise RuntimeError(
                f"CPU kernels for {self.isa} cannot run on this CPU (it supports up to {best})")
        self.ext = build_extension(self.isa)
        self._decode_rows = PerStep()  # this step's decode rows, shared by every layer
        self._decode_kernel_logged: set = set()  # (dtype, head_dim) whose decode kernel is logged
        # GGUF Q8_0 / Q4_0 / Q4_1 block kernels (gguf.py), built when the first such layer packs.
        self.gguf_kernels: gguf.GgufCpuKernels | None = None
        self.gguf_build_error: str | None = None
        self._int8_path_logged = False  # int8_panels.int8_path, logged at the first int8 layer
        # (slots, rank) -> PerStep of the step's LoRA shrink mask (lora.py)
        self._lora_masks: dict = {}
        self.bf16_attention = bool(self.ext.bf16_attention_available())
        # Prefill-chunk and vision attention are matmul-shaped: where the CPU has AMX, torch's SDPA
        # (oneDNN, AMX tiles) outruns our vdpbf16ps kernels (bench/ops.py re-derives it), so they
        # take SDPA there. Decode attention reads the cache once per token and stays ours
        # everywhere.
        has_amx = "amx_bf16" in cpu_features.cpu_flags()
        if bf16_prefill_kernels is None:
            bf16_prefill_kernels = not has_amx
        self.bf16_prefill_kernels = self.bf16_attention and bf16_prefill_kernels
        # bf16 experts in 32-output panels (moe.py): faster than the grouped GEMM at every group
        # size on AVX512-BF16 without AMX; with AMX the grouped GEMM's oneDNN tiles keep the
        # prefill.
        self.moe_panels = bool(self.ext.expert_panels_available()) and not has_amx
        # Dense linears in 32-output panels (csrc/panel_linear.cpp): float32 on AVX-512 builds, bf16
        # on AVX512-BF16 builds without AMX (with AMX, oneDNN's tiles).
        self.panel_dtypes = tuple(dtype for dtype in (torch.float32, torch.bfloat16)
                                  if self.ext.panel_linear_available(dtype) and
                                  (dtype == torch.float32 or not has_amx))
        logger.info(
            "ops[cpu]: dense linears in 32-output panels for %s; oneDNN's prepacked layout "
            "otherwise",
            ", ".join(str(d).split(".")[-1] for d in self.panel_dtypes) or "no dtype at this level")
        logger.info(
            "ops[cpu]: bf16 MoE experts run %s", "in 32-output panels (expert_panel_matmul)"
            if self.moe_panels else "on the grouped GEMM, small groups on expert_matmul" +
            (" (this CPU has AMX)" if has_amx else " (no AVX512-BF16 build)"))
        self.bf16_linear = torch.backends.mkldnn.is_available(
        ) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        if self.bf16_prefill_kernels:
            logger.info(
                "ops[cpu]: kernels built for %s; bf16 attention kernels (AVX512-BF16): decode, "
                "prefill, "
                "vision", self.isa)
        elif self.bf16_attention:
            logger.info(
                "ops[cpu]: kernels built for %s; bf16 decode attention kernel (AVX512-BF16); bf16 "
                "prefill "
                "and vision attention run SDPA (%s)", self.isa,
                "this CPU has AMX, which SDPA uses" if has_amx else "bf16_prefill_kernels=False")
        else:
            logger.info(
                "ops[cpu]: kernels built for %s; no AVX512-BF16 kernels at this level, so bf16 "
                "prefill and "
                "vision attention run SDPA", self.isa)
        logger.info("ops[cpu]: decode attention kernels: %s", self.ext.decode_attention_kernels())
        logger.info("ops[cpu]: linear-attention kernels (decode and prefill): %s",
                    self.ext.linear_attention_kernels())

    def describe(self) -> str:
        if self.bf16_attention and not self.bf16_prefill_kernels:
            return f"{self.name} ({self.isa}, SDPA for bf16 prefill/vision)"
        return f"{self.name} ({self.isa})"

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping):
        self.ext.store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def _bf16_flash(self, q) -> bool:
        """Whether attention_bf16.cpp's flash kernel takes these queries: bf16 only (in float32 SDPA
        is exact against transformers), an even head_dim up to 128 (keys are packed as bf16 pairs),
        an AVX512-BF16 build on a CPU without AMX (see __init__)."""
        return q.dtype == torch.bfloat16 and q.shape[-1] <= 128 and q.shape[-1] % 2 == 0 and \
            self.bf16_prefill_kernels

    def paged_attention(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
        # The kernel reads int32 metadata; the model runner already builds it so, other callers may
        # not.
        seq_lens, block_tables = seq_lens.to(torch.int32), block_tables.to(torch.int32)
        self._log_decode_kernel(q, k_cache)
        # Which rows decode, worked out once per step rather than in every layer (four small tensor
        # ops and a host sync each time).
        decode_rows = self._decode_rows.get(attention.decode_rows, cu_seqlens_q)
        if decode_rows is None:
            return self.ext.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                   scale)
        out = torch.empty_like(q)
        if decode_rows.numel():
            rows = decode_rows
            token_index = cu_seqlens_q[rows]
            out[token_index] = self.ext.paged_decode_attention(q[token_index], k_cache, v_cache,
                                                               block_tables[rows], seq_lens[rows],
                                                               scale)
        if self._bf16_flash(q):
            self.ext.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                       scale, out)
        else:  # float32 (torch's flash kernel is exact there), or no AVX512-BF16 (logged at load)
            reference.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                        scale, out, attention.chunk_over_context)
        return out

    def _log_decode_kernel(self, q, k_cache):
        """Once per dtype and head_dim: which kernel decodes (the fused decode stack's too), from
        the C++ dispatch itself, and which prefills; a model off the vector kernels shows here."""
        key = (q.dtype, q.shape[-1])
        if key not in self._decode_kernel_logged:
            self._decode_kernel_logged.add(key)
            logger.debug("ops[cpu]: decode attention on %s, head_dim %d: the %s kernel; prefill "
                         "attention on %s", *key, self.ext.decode_attention_kernel(q, k_cache),
                         "the AVX512-BF16 flash kernel" if self._bf16_flash(q) else "SDPA")

    # KV caches in another dtype (kv_cache.py, csrc/kv_quant.cpp).
    kv_cache_kernels = kv_cache.KV_CACHE_KERNELS

    def store_quantized_kvcache(self, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        self.ext.store_kvcache_quantized(key, value, k_cache, v_cache, k_scale, v_scale,
                                         slot_mapping)

    def quantized_paged_attention(self, q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q,
                                  seq_lens, block_tables, scale):
        decode_rows = self._decode_rows.get(attention.decode_rows, cu_seqlens_q)
        return kv_cache.quantized_paged_attention(self.ext, decode_rows, q, k_cache, v_cache,
                                                  k_scale, v_scale, cu_seqlens_q, seq_lens,
                                                  block_tables, scale, self._bf16_flash(q))

    # Hybrid models' linear attention: decode and prefill calls on our kernels, a call whose
    # tensors they do not take on the reference (linear_attention.py says the rule).
    state_cache_kernels = linear_attention.STATE_KERNEL_DTYPES
    def gated_delta_rule(self, q, k, v, g, beta, state, cu_seqlens, slots, has_state, scale):
        return linear_attention.gated_delta_rule(self.ext, q, k, v, g, beta, state, cu_seqlens,
                                                 slots, has_state, scale)

    def causal_conv1d(self, x, weight, bias, conv_state, cu_seqlens, slots, has_state):
        return linear_attention.causal_conv1d(self.ext, x, weight, bias, conv_state, cu_seqlens,
                                              slots, has_state)

    def apply_rotary(self, q, k, cos, sin):
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        self.ext.rotary_inplace(q, cos, sin)
        self.ext.rotary_inplace(k, cos, sin)
        return q, k

    def gelu_tanh(self, x):
        if not x.is_contiguous():
            return reference.gelu_tanh(x)
        return self.ext.gelu_tanh_(x)

    def varlen_attention(self, q, k, v, cu_seqlens, scale):
        if not self._bf16_flash(q):
            return reference.varlen_attention(q, k, v, cu_seqlens, scale)
        return self.ext.vision_attention(q, k, v, cu_seqlens.cpu(), scale)

    def rms_norm(self, x, weight, eps):
        # the reference then promotes the output; the kernel writes x's dtype only
        if weight.dtype != x.dtype:
            return reference.rms_norm(x, weight, eps)
        return self.ext.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if not (weight.dtype == x.dtype == residual.dtype) or x.dim() != 2:
            return reference.add_rms_norm(x, residual, weight, eps)
        return tuple(self.ext.add_rms_norm(x, residual, weight, eps))

    def silu_and_mul(self, x):
        if x.dim() != 2:
            return reference.silu_and_mul(x)
        return self.ext.silu_and_mul(x)

    def apply_token_bitmask(self, logits, rows, bitmask):
        if logits.device.type != "cpu" or logits.dim() != 2 or not logits.is_contiguous():
            return bitmask.apply_token_bitmask(logits, rows, bitmask)
        self.ext.apply_token_bitmask(logits, torch.tensor(rows, dtype=torch.long),
                                     bitmask.contiguous())

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize, expert_offset=0):
        """Grouped GEMMs over the pairs sorted by expert (moe.py), our SiLU-and-multiply between; in
        bf16 panel-packed experts on our expert_panel_matmul (see __init__), otherwise small groups
        on expert_matmul."""
        return moe.fused_moe(x, router_logits, w13, w2, top_k, renormalize, expert_offset,
                             self.silu_and_mul, self.ext.expert_matmul,
                             self.ext.expert_panel_matmul)

    def pack_moe_weights(self, w13, w2):
        return moe.pack_moe_weights(w13, w2, panels=self.moe_panels)

    def pack_lora(self, lora_a, lora_b, sub_outputs):
        has_panels = bool(self.ext.panel_linear_available(lora_a.dtype))
        return lora.pack(lora_a, lora_b, sub_outputs, has_panels)

    repack_lora = staticmethod(lora.repack_slot)

    def add_lora(self, x, y, lora_a, lora_b, groups, packed=None):
        """Small steps on the slots' panels, else dense GEMMs over the used slots (lora.py)."""
        return lora.add_lora(self.ext, x, y, lora_a, lora_b, groups, self._lora_masks, packed)

    # Quantized linears: our VNNI panels or GGUF block kernel for per-channel int8, torch's int4
    # CPU kernel and oneDNN's int8 GEMM (quant.py; int8_panels.py says which runs where).
    def pack_quantized_linear(self, scheme: str, tensors: dict) -> dict:
        vnni = self.ext if self.ext.int8_vnni_available() else None
        packed = quant.pack(scheme, tensors, quant.has_int8_dot_product(), self._block_kernels,
                            vnni)
        if scheme in ("w8a16", "w8a8_dynamic") and not self._int8_path_logged:
            self._int8_path_logged = True
            logger.info("ops[cpu]: per-channel int8 layers run %s", int8_panels.int8_path(self.ext))
        if "cpu" in packed:
            op = {"w8a8_dynamic": self.w8a8_dynamic_linear,
                  "w8a8_static": self.w8a8_static_linear}.get(scheme, self.weight_only_linear)
            quant.check_kernel(scheme, packed, op)
        return packed

    weight_only_linear = staticmethod(quant.weight_only_linear)
    w8a8_dynamic_linear = staticmethod(quant.w8a8_dynamic_linear)
    w8a8_static_linear = staticmethod(quant.w8a8_static_linear)

    # GGUF Q8_0 / Q4_0 / Q4_1 block weights (and per-channel int8, as Q8_0 blocks): our kernels
    # (gguf.py), built when the first such layer packs.
    def _block_kernels(self) -> gguf.GgufCpuKernels | None:
        """The GGUF block kernels for this CPU, built on first use; None (logged once) where they do
        not build."""
        if self.gguf_kernels is None and self.gguf_build_error is None:
            try:
                self.gguf_kernels = gguf.GgufCpuKernels(self.isa)
            except Exception as e:  # no compiler: the layers run the reference, loudly
                self.gguf_build_error = f"{type(e).__name__}: {str(e)[:200]}"
                logger.warning(
                    "ops[cpu]: GGUF block kernels unavailable (%s); GGUF and int8 layers run the "
                    "pure-torch reference (dequantize + matmul per call)", self.gguf_build_error)
                return None
            logger.info("ops[cpu]: GGUF Q8_0/Q4_0/Q4_1 kernels built for %s", self.gguf_kernels.isa)
        return self.gguf_kernels

    def pack_gguf_weight(self, weight, ggml_type):
        kernels = self._block_kernels()
        return None if kernels is None else kernels.pack(weight, ggml_type)

    def gguf_linear(self, x, weight, ggml_type, bias=None):
        # A packed weight (3-D) runs the kernel; the file's blocks (2-D: the kernels failed to
        # build, which pack_gguf_weight logged) run the reference.
        if weight.dim() == 2:
            return gguf_reference.gguf_linear(x, weight, ggml_type, bias)
        return self.gguf_kernels.linear(x, weight, ggml_type, bias)

    def gguf_embedding(self, ids, weight, ggml_type, dtype):
        kernels = self.gguf_kernels
        if kernels is None:
            return gguf_reference.gguf_embedding(ids, weight, ggml_type, dtype)
        rows = kernels.dequantize(weight.index_select(0, ids.reshape(-1)), ggml_type)
        return rows.to(dtype).reshape(*ids.shape, -1)

    def linear(self, x, weight, bias=None):
        return linear.linear(self.ext, x, weight, bias)

    def dense_decode_stack(self, layers, num_heads, num_kv_heads, head_dim, scale, eps, qk_eps,
                           kv_cache_dtype=None):
        """csrc/decode_layer.cpp: every layer's kernels in their modules' order, without the Python
        between them, where all four projections of every layer are on panels (dense, or int8
        W8A16 on the VNNI panels: int8_panels.decode_kernel; norms in their activations' dtype)
        and a cache in another dtype is one csrc/kv_quant.cpp reads."""
        if kv_cache_dtype is not None and kv_cache_dtype not in self.kv_cache_kernels:
            return None
        dtype = layers[0]["input_norm"].dtype
        int8 = []  # per layer: the four int8 kernels, or None (dense panels)
        for layer in layers:
            projections = [layer[name] for name in ("qkv", "o", "gate_up", "down")]
            norms = [
                w
                for w in (layer["input_norm"], layer["post_norm"], layer["q_norm"], layer["k_norm"])
                if w is not None
            ]
            if not all(w.dtype == dtype for w in norms):
                return None
            if any(isinstance(w, dict) for w in projections):
                kernels = [int8_panels.decode_kernel(w) if isinstance(w, dict) else None
                           for w in projections]
                if any(k is None for k in kernels):
                    logger.info("ops[cpu]: the fused decode layers take int8 weights on the VNNI "
                                "panels only; these layers' int8 weights run %s",
                                int8_panels.int8_path(self.ext))
                    return None
                int8.append(kernels)
            elif all(w.dim() > 2 and not w.is_mkldnn and w.dtype == dtype for w in projections):
                int8.append(None)
            else:
                return None
        stack = self.ext.DenseDecodeStack(num_heads, num_kv_heads, head_dim, scale, eps, qk_eps,
                                          int8_widen_rows=int8_panels.WIDEN_ROWS)
        for layer, kernels in zip(layers, int8):
            if kernels is None:
                stack.add_layer(**layer)
                continue
            weights = {name: k["weight"] for name, k in zip(("qkv", "o", "gate_up", "down"),
                                                             kernels)}
            stack.add_layer(**{**layer, **weights}, int8_comp=[k["comp"] for k in kernels],
                            int8_scale=[k["scale"] for k in kernels])
        return stack

    def pack_linear_weight(self, weight: torch.Tensor,
                           large_rows: bool = False) -> torch.Tensor | None:
        return linear.pack_linear_weight(weight, large_rows, self.panel_dtypes, self.bf16_linear)
