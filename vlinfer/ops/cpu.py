"""Our compiled CPU kernels (kernels/cpu/paged_ops.cpp, attention_bf16.cpp, moe_experts.cpp, panel_linear.cpp,
decode_layer.cpp), built on first use with torch's extension builder; every projection on a packed weight (ours or
oneDNN's). Decode attention, the cache write, rotary, the norms, SiLU-and-multiply and tanh GELU run the kernels;
the norms and activations are memory-bound passes the reference spreads over several tensor ops each.

Which code the kernels run is chosen from the CPU the engine runs on, at load time (cpu_features.cpu_isa): the
sources are compiled once per instruction-set level (generic x86-64, AVX2, AVX-512, AVX-512 with BF16), each into
its own extension name, so a kernel cache built for one CPU is never loaded on a CPU that lacks its instructions
(torch's cache is keyed by name). `CpuOps(isa=...)` builds a lower level on purpose: tests run the generic path
and every level the test machine supports.

Attention in bfloat16 on CPUs with AVX512-BF16 (prefill chunks, decode, the vision tower) runs our vdpbf16ps
kernels: torch's SDPA CPU kernel reaches about a third of the bf16 matmul rate on these shapes without AMX. In
float32, prefill and vision attention stay on torch's flash kernel (SDPA), which is exact against transformers; a
prefill chunk over a cached context runs it twice, merged by log-sum-exp (cpu_prefill.py). Matmuls are oneDNN's:
it uses AMX where the CPU has it, so we write no AMX code of our own.

Linear layers: torch's F.linear re-lays out the weight for oneDNN (bf16) or runs MKL (float32) on every call;
`pack_linear_weight` converts a projection's weight once into a packed layout the layer keeps instead of its
parameter: our 32-output panels (kernels/cpu/panel_linear.cpp; float32 on AVX-512, bf16 on AVX512-BF16 without
AMX; panels up to PANEL_BYTES), else oneDNN's blocked layout (an opaque mkldnn tensor; with AMX its tiles). oneDNN
against F.linear: 1.2-1.3x on decode-sized matmuls (32 rows), 2x in float32, 1.05-1.15x at prefill sizes,
bit-identical in bfloat16. Panels against oneDNN (2-vCPU EPYC, SmolLM2, in the engine): single stream 1.25-1.3x
float32, 1.3-1.4x bf16; a 64-request batch 1.14-1.16x float32, 1.06-1.2x bf16; within one bf16 rounding of F.linear
(another summation order).

Decode steps of a dense model whose projections are all on panels run every decoder layer in one call
(`dense_decode_stack`, kernels/cpu/decode_layer.cpp): the same kernels, without the modules' Python between them.
Single stream on the EPYC, SmolLM2, alternated in one process: float32 1.2x, bf16 1.2-1.3x; a 64-request batch
1.0-1.1x; greedy tokens identical."""
import glob
import hashlib
import logging
import os

import torch
import torch.nn.functional as F

from vlinfer.platform import cpu_features
from vlinfer.ops import (cpu_lora, cpu_moe, cpu_panels, cpu_prefill, cpu_quant, gguf_cpu, gguf_reference,
                         kv_quant_reference, reference, token_bitmask_reference)
from vlinfer.ops.per_step import PerStep
from vlinfer.ops.cpu_isa_flags import CPU_KERNEL_DIR, ISA_FLAGS
from vlinfer.ops.reference import ReferenceOps

logger = logging.getLogger("vlinfer")
SOURCES = tuple(os.path.join(CPU_KERNEL_DIR, name) for name in ("paged_ops.cpp", "attention_bf16.cpp",
                                                                 "moe_experts.cpp", "panel_linear.cpp",
                                                                 "decode_layer.cpp", "kv_quant.cpp",
                                                                 "lora_panels.cpp"))
# dtypes whose prepacked linear oneDNN runs (bf16 needs AVX512-BF16 or AMX, checked at packing time)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Largest panel (32 x K weights) a dense linear takes panels for: the 8-row tiles re-read it from L2 (1 MB here);
# past it oneDNN led at prefill sizes (kernels/cpu/panel_linear.cpp).
PANEL_BYTES = 256 * 1024


def build_extension(isa: str):
    """Compile (first time for this level on this machine) and import the kernels for one instruction-set level."""
    from torch.utils.cpp_extension import load as load_extension
    sources = list(SOURCES)
    for source in sources:
        if not os.path.exists(source):
            raise FileNotFoundError(f"kernel source {source} is missing (the package was built without its data)")
    # torch keys its build cache by the sources' contents and the flags, not by the headers they include: a digest
    # of the headers in the flags makes a changed header rebuild too.
    headers = sorted(glob.glob(os.path.join(CPU_KERNEL_DIR, "*.h")))
    digest = hashlib.sha256(b"".join(open(h, "rb").read() for h in headers)).hexdigest()[:16]
    flags = ["-O3", "-fopenmp", "-ffast-math", *ISA_FLAGS[isa], f"-DVLINFER_HEADERS_DIGEST={digest}"]
    return load_extension(f"vlinfer_cpu_kernels_{isa}", sources, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                          verbose=False)


LARGE_ROWS_STEP = 512  # above this many rows, a prepacked linear's buckets are its multiples


def linear_rows_bucket(rows: int) -> int:
    """The row count a prepacked linear runs at: 1-8 exact (single streams and small batches pay nothing), then
    powers of two to 64, multiples of 64 to 512, multiples of 512 above (chunked prefill sizes)."""
    if rows <= 8:
        return rows
    if rows <= 64:
        return 1 << (rows - 1).bit_length()
    step = 64 if rows <= LARGE_ROWS_STEP else LARGE_ROWS_STEP
    return -(-rows // step) * step


def linear_row_blocks(rows: int) -> list[int]:
    """The row blocks a prepacked linear runs `rows` rows in, each padded to its bucket: one block; or, above
    LARGE_ROWS_STEP rows, whole blocks of LARGE_ROWS_STEP rows and then the rest in its own smaller bucket where that
    pads fewer rows: the same kernels, at most 63 padding rows instead of up to 511 (3152 vision rows ran as 3584)."""
    head = rows // LARGE_ROWS_STEP * LARGE_ROWS_STEP
    if rows > LARGE_ROWS_STEP and linear_rows_bucket(rows - head) - (rows - head) < linear_rows_bucket(rows) - rows:
        return [head, rows - head]
    return [rows]


def _decode_rows(cu_seqlens_q: torch.Tensor) -> torch.Tensor | None:
    """Indices of the sequences that bring one query token this step; None when every one does."""
    decode = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]) == 1
    return None if bool(decode.all()) else decode.nonzero().squeeze(1)


class CpuOps(ReferenceOps):
    name = "cpu-compiled"

    def __init__(self, device_type: str = "cpu", isa: str | None = None, bf16_prefill_kernels: bool | None = None):
        """isa: the instruction-set level to build and run; None takes the best this CPU has. Asking for a level
        the CPU lacks raises (its code would die on an illegal instruction). bf16_prefill_kernels: run our bf16
        prefill and vision attention kernels (True), SDPA (False), or decide from the CPU (None; see below)."""
        super().__init__(device_type)
        best = cpu_features.cpu_isa()
        self.isa = isa or best
        if self.isa not in ISA_FLAGS:
            raise ValueError(f"unknown CPU kernel level {self.isa!r}; expected one of {', '.join(ISA_FLAGS)}")
        if cpu_features.CPU_ISAS.index(self.isa) > cpu_features.CPU_ISAS.index(best):
            raise RuntimeError(f"CPU kernels for {self.isa} cannot run on this CPU (it supports up to {best})")
        self.ext = build_extension(self.isa)
        self._decode_rows = PerStep()  # this step's decode rows, shared by every layer
        self._lora_masks: dict = {}  # (slots, rank) -> PerStep of the step's LoRA shrink mask (cpu_lora.py)
        self.bf16_attention = bool(self.ext.bf16_attention_available())
        # Prefill-chunk and vision attention are matmul-shaped: where the CPU has AMX, torch's SDPA (oneDNN, AMX
        # tiles) runs them 2.7-3.3x faster than our vdpbf16ps kernels (bench/ops.py, Xeon with amx_bf16), so
        # they take SDPA there. Decode attention reads the cache once per token and stays ours everywhere.
        has_amx = "amx_bf16" in cpu_features.cpu_flags()
        if bf16_prefill_kernels is None:
            bf16_prefill_kernels = not has_amx
        self.bf16_prefill_kernels = self.bf16_attention and bf16_prefill_kernels
        # bf16 experts in 32-output panels (ops/cpu_moe.py): faster than the grouped GEMM at every group size on
        # AVX512-BF16 without AMX; with AMX the grouped GEMM's oneDNN tiles keep the prefill.
        self.moe_panels = bool(self.ext.expert_panels_available()) and not has_amx
        # Dense linears in 32-output panels (kernels/cpu/panel_linear.cpp): float32 on AVX-512 builds, bf16 on
        # AVX512-BF16 builds without AMX (with AMX, oneDNN's tiles).
        self.panel_dtypes = tuple(dtype for dtype in (torch.float32, torch.bfloat16)
                                  if self.ext.panel_linear_available(dtype) and
                                  (dtype == torch.float32 or not has_amx))
        logger.info("ops[cpu]: dense linears in 32-output panels for %s; oneDNN's prepacked layout otherwise",
                    ", ".join(str(d).split(".")[-1] for d in self.panel_dtypes) or "no dtype at this level")
        logger.info("ops[cpu]: bf16 MoE experts run %s", "in 32-output panels (expert_panel_matmul)" if self.moe_panels
                    else "on the grouped GEMM, small groups on expert_matmul" + (" (this CPU has AMX)" if has_amx
                                                                                 else " (no AVX512-BF16 build)"))
        self.bf16_linear = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        if self.bf16_prefill_kernels:
            logger.info("ops[cpu]: kernels built for %s; bf16 attention kernels (AVX512-BF16): decode, prefill, "
                        "vision", self.isa)
        elif self.bf16_attention:
            logger.info("ops[cpu]: kernels built for %s; bf16 decode attention kernel (AVX512-BF16); bf16 prefill "
                        "and vision attention run SDPA (%s)", self.isa,
                        "this CPU has AMX, which SDPA uses" if has_amx else "bf16_prefill_kernels=False")
        else:
            logger.info("ops[cpu]: kernels built for %s; no AVX512-BF16 kernels at this level, so bf16 prefill and "
                        "vision attention run SDPA", self.isa)
        logger.info("ops[cpu]: decode attention kernels: %s", self.ext.decode_attention_kernels())

    def describe(self) -> str:
        if self.bf16_attention and not self.bf16_prefill_kernels:
            return f"{self.name} ({self.isa}, SDPA for bf16 prefill/vision)"
        return f"{self.name} ({self.isa})"

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping):
        self.ext.store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def _bf16_flash(self, q) -> bool:
        """Whether attention_bf16.cpp's flash kernel takes these queries: bf16 only (in float32 SDPA is exact
        against transformers), an even head_dim up to 128 (keys are packed as bf16 pairs), an AVX512-BF16 build on
        a CPU without AMX (see __init__)."""
        return q.dtype == torch.bfloat16 and q.shape[-1] <= 128 and q.shape[-1] % 2 == 0 and \
            self.bf16_prefill_kernels

    def paged_attention(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
        # The kernel reads int32 metadata; the model runner already builds it so, other callers may not.
        seq_lens, block_tables = seq_lens.to(torch.int32), block_tables.to(torch.int32)
        # Which rows decode, worked out once per step rather than in every layer (four small tensor ops and a host
        # sync each time).
        decode_rows = self._decode_rows.get(_decode_rows, cu_seqlens_q)
        if decode_rows is None:
            return self.ext.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
        out = torch.empty_like(q)
        if decode_rows.numel():
            rows = decode_rows
            token_index = cu_seqlens_q[rows]
            out[token_index] = self.ext.paged_decode_attention(q[token_index], k_cache, v_cache, block_tables[rows],
                                                               seq_lens[rows], scale)
        if self._bf16_flash(q):
            self.ext.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out)
        else:  # float32 (torch's flash kernel is exact there), or no AVX512-BF16 (logged at load)
            reference.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out,
                                        cpu_prefill.chunk_over_context)
        return out

    # KV caches in another dtype (kernels/cpu/kv_quant.cpp): the write and decode attention read the stored rows;
    # prefill chunks read their blocks back in the compute dtype (kv_quant_reference) for SDPA.
    kv_cache_kernels = (torch.int8, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)

    def store_quantized_kvcache(self, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        self.ext.store_kvcache_quantized(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)

    def quantized_paged_attention(self, q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, seq_lens, block_tables,
                                  scale):
        seq_lens, block_tables = seq_lens.to(torch.int32), block_tables.to(torch.int32)
        decode_rows = self._decode_rows.get(_decode_rows, cu_seqlens_q)
        if decode_rows is None:
            return self.ext.paged_decode_attention_quantized(q, k_cache, v_cache, k_scale, v_scale, block_tables,
                                                             seq_lens, scale)
        out = torch.empty_like(q)
        prefill_tables = block_tables
        if decode_rows.numel():
            token_index = cu_seqlens_q[decode_rows]
            out[token_index] = self.ext.paged_decode_attention_quantized(
                q[token_index], k_cache, v_cache, k_scale, v_scale, block_tables[decode_rows], seq_lens[decode_rows],
                scale)
            prefill_tables = block_tables.index_fill(0, decode_rows, -1)  # their blocks need no reading back
        k, v, tables = kv_quant_reference.dequantized_blocks(k_cache, v_cache, k_scale, v_scale, prefill_tables,
                                                             q.dtype)
        reference.prefill_attention(q, k, v, cu_seqlens_q, seq_lens, tables, scale, out, cpu_prefill.chunk_over_context)
        return out

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
        if weight.dtype != x.dtype:  # the reference then promotes the output; the kernel writes x's dtype only
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
            return token_bitmask_reference.apply_token_bitmask(logits, rows, bitmask)
        self.ext.apply_token_bitmask(logits, torch.tensor(rows, dtype=torch.long), bitmask.contiguous())

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize, expert_offset=0):
        """Grouped GEMMs over the pairs sorted by expert (ops/cpu_moe.py), our SiLU-and-multiply between; in bf16
        panel-packed experts on our expert_panel_matmul (see __init__), otherwise small groups on expert_matmul."""
        return cpu_moe.fused_moe(x, router_logits, w13, w2, top_k, renormalize, expert_offset, self.silu_and_mul,
                                 self.ext.expert_matmul, self.ext.expert_panel_matmul)

    def pack_moe_weights(self, w13, w2):
        return cpu_moe.pack_moe_weights(w13, w2, panels=self.moe_panels)

    def pack_lora(self, lora_a, lora_b, sub_outputs):
        return cpu_lora.pack(lora_a, lora_b, sub_outputs, bool(self.ext.panel_linear_available(lora_a.dtype)))

    repack_lora = staticmethod(cpu_lora.repack_slot)

    def add_lora(self, x, y, lora_a, lora_b, groups, packed=None):
        """Small steps on the slots' panels, else dense GEMMs over the used slots (ops/cpu_lora.py)."""
        return cpu_lora.add_lora(self.ext, x, y, lora_a, lora_b, groups, self._lora_masks, packed)

    # Quantized linears: our GGUF block kernel for per-channel int8, torch's int4 CPU kernel and oneDNN's int8 GEMM
    # (ops/cpu_quant.py).
    def pack_quantized_linear(self, scheme: str, tensors: dict) -> dict:
        packed = cpu_quant.pack(scheme, tensors, cpu_quant.has_int8_dot_product(), self.block_kernels)
        if "cpu" in packed:
            op = {"w8a8_dynamic": self.w8a8_dynamic_linear, "w8a8_static": self.w8a8_static_linear}.get(
                scheme, self.weight_only_linear)
            cpu_quant.check_kernel(scheme, packed, op)
        return packed

    weight_only_linear = staticmethod(cpu_quant.weight_only_linear)
    w8a8_dynamic_linear = staticmethod(cpu_quant.w8a8_dynamic_linear)
    w8a8_static_linear = staticmethod(cpu_quant.w8a8_static_linear)

    # GGUF Q8_0 / Q4_0 / Q4_1 block weights (and per-channel int8, as Q8_0 blocks): our kernels (ops/gguf_cpu.py),
    # built when the first such layer packs.
    gguf_kernels: gguf_cpu.GgufCpuKernels | None = None
    gguf_build_error: str | None = None

    def block_kernels(self) -> gguf_cpu.GgufCpuKernels | None:
        """The GGUF block kernels for this CPU, built on first use; None (logged once) where they do not build."""
        if self.gguf_kernels is None and self.gguf_build_error is None:
            try:
                self.gguf_kernels = gguf_cpu.GgufCpuKernels(self.isa)
            except Exception as e:  # no compiler: the layers run the reference, loudly
                self.gguf_build_error = f"{type(e).__name__}: {str(e)[:200]}"
                logger.warning("ops[cpu]: GGUF block kernels unavailable (%s); GGUF and int8 layers run the "
                               "pure-torch reference (dequantize + matmul per call)", self.gguf_build_error)
                return None
            logger.info("ops[cpu]: GGUF Q8_0/Q4_0/Q4_1 kernels built for %s", self.gguf_kernels.isa)
        return self.gguf_kernels

    def pack_gguf_weight(self, weight, ggml_type):
        kernels = self.block_kernels()
        return None if kernels is None else kernels.pack(weight, ggml_type)

    def gguf_linear(self, x, weight, ggml_type, bias=None):
        # A packed weight (3-D) runs the kernel; the file's blocks (2-D: the kernels failed to build, which
        # pack_gguf_weight logged) run the reference.
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
        if not weight.is_mkldnn and weight.dim() > 2:  # 32-output panels (pack_linear_weight)
            y = self.ext.panel_linear(x.reshape(-1, x.shape[-1]), weight, bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        if not weight.is_mkldnn:
            return F.linear(x, weight, bias)
        rows = x.shape[0] if x.dim() == 2 else 0
        blocks = linear_row_blocks(rows)
        if len(blocks) > 1:
            return torch.cat([self.linear(block, weight, bias) for block in x.split(blocks)])
        padded = linear_rows_bucket(rows)
        if padded == rows or rows == 0:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        # oneDNN JITs (and keeps) one kernel per distinct row count of a prepacked linear, about half a MiB each:
        # under continuous batching every new batch size grew the process. Rows padded to a few buckets bound
        # that; rows are independent in a matmul, so the padding changes no real row's result.
        # Only the padding rows are zeroed: a whole zeroed buffer cost 8% of a video prefill in fills (profiled,
        # [13824, 4096] vision MLP inputs).
        x_padded = x.new_empty(padded, x.shape[1])
        x_padded[:rows] = x
        x_padded[rows:].zero_()
        return torch.ops.mkldnn._linear_pointwise(x_padded, weight, bias, "none", [], "")[:rows]

    def dense_decode_stack(self, layers, num_heads, num_kv_heads, head_dim, scale, eps, qk_eps):
        """kernels/cpu/decode_layer.cpp: every layer's kernels in their modules' order, without the Python between
        them, where all four projections of every layer are on panels (norms in their activations' dtype)."""
        dtype = layers[0]["qkv"].dtype
        for layer in layers:
            projections = [layer[name] for name in ("qkv", "o", "gate_up", "down")]
            norms = [w for w in (layer["input_norm"], layer["post_norm"], layer["q_norm"], layer["k_norm"])
                     if w is not None]
            if not all(w.dim() > 2 and not w.is_mkldnn and w.dtype == dtype for w in projections) or \
                    not all(w.dtype == dtype for w in norms):
                return None
        stack = self.ext.DenseDecodeStack(num_heads, num_kv_heads, head_dim, scale, eps, qk_eps)
        for layer in layers:
            stack.add_layer(**layer)
        return stack

    def pack_linear_weight(self, weight: torch.Tensor, large_rows: bool = False) -> torch.Tensor | None:
        """Our 32-output panels of a [out, in] weight where the kernels run them (see __init__) and the shape fits
        (whole panels, pairs of k, a panel of at most PANEL_BYTES); else oneDNN's blocked layout; None where this
        CPU / torch build has neither for its dtype, and for float32 weights of layers that only run large row
        counts (the layer then keeps F.linear; pack_weights logs which)."""
        if weight.is_mkldnn or weight.dim() != 2:
            return None
        if large_rows and weight.dtype == torch.float32:
            # Both packed layouts pay off at decode's few rows; from a few hundred rows up, MKL's sgemm behind
            # F.linear on the plain weight is the faster float32 kernel (docs/benchmarks.md).
            return None
        n, k = weight.shape
        if weight.dtype in self.panel_dtypes and n % cpu_panels.PANEL == 0 and k % 2 == 0 and \
                cpu_panels.PANEL * k * weight.element_size() <= PANEL_BYTES:
            return cpu_panels.to_panels(weight.detach())
        if weight.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
            return None
        if weight.dtype == torch.bfloat16 and not self.bf16_linear:
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
