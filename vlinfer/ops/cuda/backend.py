"""`CudaOps`: our Triton KV cache write (triton/store_kvcache.py), FlashAttention's varlen and
paged-KV calls where `flash_attn` is installed, our Triton attention otherwise (attention.py); KV
caches in another dtype on our Triton kernels (kv_cache.py); the fused MoE (moe.py), LoRA (lora.py),
quantized linears (quant.py) and hybrid models' linear attention (linear_attention.py) on our Triton
kernels, loaded when a layer first asks (loader.py).
Rotary, norms and SwiGLU stay on the pure-torch reference, which on CUDA is a handful of elementwise
kernels.

- Block size: flash_attn's paged KV cache (`block_table`) needs a page block size that is a multiple
  of 256 (its
  documented constraint for flash_attn_with_kvcache and the paged flash_attn_varlen_func, flash-attn
  2.x).
  default_block_size picks 256 when flash_attn is installed; with another block size, or a float32
  model (flash_attn takes fp16/bf16), attention runs our kernel or the SDPA path instead, logged
  once per engine.
- Without flash_attn, or where it does not apply: our Triton attention (triton/paged_attention.py):
  one launch for a step's prefill chunks, prefix hits and decodes, reading each sequence's own
  blocks, split over the keys for decode steps with few sequences; and the vision tower's packed
  images in one launch.
- Graph safety: a decode-only batch is recognised from shapes alone (T == B: every sequence brings
  one token, none
  brings zero), and its attention takes no device->host sync and no data-dependent shape:
  flash_attn_with_kvcache
  with cache_seqlens and the block table, or our kernel (its grid and splits from shapes). With the
  Triton cache
  write, a decode step can therefore be captured in a CUDA graph (graph.py).
- Triton missing or failing on this machine: a warning, and the reference cache write (which syncs:
  no graphs) and
  attention (a matmul over the block table's whole width for decode, SDPA per sequence or image
  otherwise).

Where this has run on a GPU is in docs/benchmarks.md "Kernel decisions" (bench/cuda_check.sh re-runs
it). tests/ops/cuda/test_cuda_ops.py runs CudaOps on CPU tensors with the Triton kernels under the
Triton interpreter and an emulated flash_attn (tests/fakes/fake_flash_attn.py).
"""
import importlib.util
import logging

import torch

from vlinfer.ops import reference
from vlinfer.ops.cuda import graph
from vlinfer.ops.cuda import linear_attention as cuda_linear_attention
from vlinfer.ops.cuda import lora as cuda_lora
from vlinfer.ops.cuda import moe as cuda_moe
from vlinfer.ops.cuda import quant as cuda_quant
from vlinfer.ops.cuda import attention as cuda_attention
from vlinfer.ops.cuda import kv_cache as cuda_kv_cache
from vlinfer.ops.cuda.attention import (FLASH_BLOCK_MULTIPLE, HALF_DTYPES, decode_attention,
                                        max_segment)
from vlinfer.ops.cuda.kv_cache import COMPRESSED_KV_DTYPES
from vlinfer.ops.cuda.loader import TritonKernels, error_reason
from vlinfer.ops.interface import PerStep
from vlinfer.ops.reference import ReferenceOps
from vlinfer.ops.reference import moe as moe_reference

logger = logging.getLogger("vlinfer")
NAME = "cuda"


class CudaOps(ReferenceOps):
    """The CUDA op table of one engine: the cache write, paged and vision attention overridden, the
    rest inherited from the reference. Everything loading found (the Triton kernel, flash_attn,
    warnings given, per-step host metadata) is this instance's."""
    name = NAME

    def __init__(self, device_type: str = "cuda"):
        """Load the Triton cache write and flash_attn, each checked on a tiny problem against the
        reference. Raises on a device these ops cannot serve; a missing or broken Triton or
        flash_attn is logged, not raised."""
        if device_type not in ("cuda", "cpu"):  # CPU tensors only for tests (VLINFER_OPS=cuda)
            raise RuntimeError(
                "the CUDA ops run on CUDA devices (or CPU tensors, for tests), not on "
                f"{device_type!r}"
            )
        super().__init__(device_type)
        # What loading found: "cache_write", "moe", "quantized_linear", "lora", "linear_attention"
        # ("triton" or "reference"; the last four on first use) and "attention" ("flash_attn" or
        # "sdpa").
        self.features: dict = {}
        self._triton = TritonKernels(self.features)
        self._flash = None
        self._warned: set = set()  # reasons already logged, once per engine
        # per-step host metadata, see attention.paged_meta
        self._step, self._varlen_step = PerStep(), PerStep()
        device = torch.device(device_type)

        # At start, not on first use: whether decode steps can run in CUDA graphs depends on it.
        self._triton_store = self._triton.get(
            "cache_write", lambda: cuda_attention.checked_cache_write(device), "KV cache write",
            "writing the cache with the pure-torch reference, which syncs with the host, so decode "
            "steps cannot run "
            "in CUDA graphs")

        # Our paged and varlen attention: where flash_attn is missing or does not apply. At start:
        # graph capture and its table width depend on it.
        self._attention = self._triton.get(
            "paged_attention", lambda: cuda_attention.checked_attention(device), "paged attention",
            "attention runs the pure-torch reference (decode: a matmul over the block table's "
            "whole width; prefill: "
            "SDPA per sequence with a host sync; the vision tower: SDPA per image)")
        ours = "our Triton kernels" if self._attention is not None else "the pure-torch reference"
        try:
            import flash_attn
            self._flash = flash_attn  # the check runs the real call paths, which read it
            self._check_flash(device)
            self.features["attention"] = "flash_attn"
        except Exception as e:
            self._flash = None
            self.features["attention"] = "triton" if self._attention is not None else "reference"
            if isinstance(e, ModuleNotFoundError) and e.name == "flash_attn":
                logger.info("ops[cuda]: flash_attn not installed; attention runs %s", ours)
            # installed but broken: built for another torch or GPU, a missing dependency, wrong
            # results, ...
            else:
                logger.warning("ops[cuda]: flash_attn unusable (%s); attention runs %s",
                               error_reason(e), ours)
        self._step.reset()  # drop the check's tensors
        logger.info(
            "ops[cuda]: cache write %s; attention %s", self.features["cache_write"],
            f"flash_attn {getattr(self._flash, '__version__', '')} (paged: block sizes that are "
            "multiples of "
            f"{FLASH_BLOCK_MULTIPLE}; others and float32 run {ours})"
            if self._flash is not None else f"{ours} (prefill, decode and the vision tower)")

    @classmethod
    def default_block_size(cls, device_type: str) -> int:
        # flash_attn's paged KV cache needs a multiple of 256; other sizes run our kernel or SDPA.
        if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            return FLASH_BLOCK_MULTIPLE
        return super().default_block_size(device_type)

    def graph_capture(self, device: torch.device):
        if device.type != "cuda":
            return super().graph_capture(device)
        return graph.backend(device, self)

    def _check_flash(self, device: torch.device) -> None:
        """A decode and a prefill chunk after a cached prefix over a 256-token paged cache, against
        the reference."""
        for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
            if not hasattr(self._flash, name):
                raise RuntimeError(
                    f"flash_attn {getattr(self._flash, '__version__', '?')} has no {name}")
        dtype = torch.float16
        if device.type != "cuda" or torch.cuda.is_bf16_supported():
            dtype = torch.bfloat16
        g = torch.Generator().manual_seed(0)
        bs = FLASH_BLOCK_MULTIPLE
        k_cache = torch.randn(3, bs, 1, 64, generator=g).to(device, dtype)
        v_cache = torch.randn(3, bs, 1, 64, generator=g).to(device, dtype)
        tables = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32, device=device)
        q = torch.randn(4, 2, 64, generator=g).to(device, dtype)
        cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
        lens = torch.tensor([300, 5], dtype=torch.int32, device=device)
        ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, lens,
                                        tables, 0.125)
        mixed = self._flash_varlen(q, k_cache, v_cache, cu, lens, tables, 0.125)
        decode = self._flash_decode(q[:2], k_cache, v_cache, lens, tables, 0.125)
        cu_decode = torch.arange(3, dtype=torch.int32, device=device)
        ref_decode = reference.paged_attention(q[:2].float(), k_cache.float(), v_cache.float(),
                                               cu_decode, lens, tables, 0.125)
        for ours, expected in ((mixed, ref), (decode, ref_decode)):
            err = ((ours.float() - expected).abs().max() / expected.abs().max()).item()
            if not err < 2e-2:
                raise RuntimeError(f"flash_attn is off from the reference by {err:.3g}")

    # ---- KV cache write ----

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping):
        if self._triton_store is None:  # warned at load
            return reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
        self._triton_store(key, value, k_cache, v_cache, slot_mapping)

    # ---- fused MoE (moe.py, triton/fused_moe.py) ----

    def _moe_kernel(self):
        """The checked Triton fused_experts, or None (logged once) when it cannot run here."""
        return self._triton.get(
            "moe", lambda: cuda_moe.checked_kernel(torch.device(self.device_type)), "fused MoE",
            "MoE layers run the pure-torch reference (a loop over experts with host syncs: no "
            "CUDA graphs)")

    def pack_moe_weights(self, w13, w2):
        self._moe_kernel()  # at load: the kernels read w13 [E, 2I, H] / w2 [E, H, I] as loaded
        return None

    def fused_moe(self, x, router_logits, w13, w2, top_k, renormalize, expert_offset=0):
        kernel = self._moe_kernel()
        if kernel is None:  # warned at load
            return moe_reference.fused_moe(x, router_logits, w13, w2, top_k, renormalize,
                                           expert_offset)
        return cuda_moe.fused_moe(kernel, x, router_logits, w13, w2, top_k, renormalize,
                                  expert_offset)

    # ---- LoRA (lora.py, triton/lora.py) ----

    def add_lora(self, x, y, lora_a, lora_b, groups, packed=None):
        kernel = self._triton.get(
            "lora", lambda: cuda_lora.checked_kernel(torch.device(self.device_type)),
            "LoRA shrink / expand", "LoRA updates run the pure-torch reference (one "
            "shrink-expand per adapter)")
        if kernel is None:  # warned on first use
            return reference.add_lora(x, y, lora_a, lora_b, groups)
        return cuda_lora.add_lora(kernel, x, y, lora_a, lora_b, groups)

    # ---- linear attention of hybrid models (linear_attention.py, triton/linear_attention.py) ----

    # The recurrent state dtypes the kernels take (engine/cache_pool.py logs any other at load).
    state_cache_kernels = cuda_linear_attention.STATE_KERNEL_DTYPES

    def _linear_attention_kernels(self):
        return self._triton.get(
            "linear_attention",
            lambda: cuda_linear_attention.checked_kernels(torch.device(self.device_type)),
            "linear attention", "the causal conv1d and the gated delta rule run the pure-torch "
            "reference (a loop over sequences with host syncs: no CUDA graphs)")

    def state_graph_refusal(self, state_dtype):
        # asked at engine start for a hybrid model in graph mode: the kernels load (and are
        # checked) here, before any capture
        if self._linear_attention_kernels() is None:
            return "the Triton linear-attention kernels are unavailable (warned above)"
        return cuda_linear_attention.graph_refusal(state_dtype)

    def causal_conv1d(self, x, weight, bias, conv_state, cu_seqlens, slots, has_state):
        return cuda_linear_attention.causal_conv1d(self._linear_attention_kernels(), x, weight,
                                                   bias, conv_state, cu_seqlens, slots, has_state)

    def gated_delta_rule(self, q, k, v, g, beta, state, cu_seqlens, slots, has_state, scale):
        return cuda_linear_attention.gated_delta_rule(self._linear_attention_kernels(), q, k, v,
                                                      g, beta, state, cu_seqlens, slots,
                                                      has_state, scale)

    # ---- quantized linears (quant.py, triton/int8_gemm.py, weight_only_gemm.py) ----

    def _quant_kernels(self):
        """The checked Triton quantized GEMMs, or None (logged once); first asked at a quantized
        layer's pack, and kept as _triton_quant too, like _triton_store."""
        self._triton_quant = self._triton.get(
            "quantized_linear", lambda: cuda_quant.QuantKernels(torch.device(self.device_type)),
            "quantized GEMMs",
            "quantized linears run the pure-torch reference (dequantize + matmul)")
        return self._triton_quant

    def pack_quantized_linear(self, scheme, tensors):
        return cuda_quant.pack(self._quant_kernels(), scheme, tensors)

    def w8a8_dynamic_linear(self, x, packed, bias=None):
        return cuda_quant.w8a8_dynamic_linear(self._quant_kernels(), x, packed, bias)

    def w8a8_static_linear(self, x, packed, bias=None):
        return cuda_quant.w8a8_static_linear(self._quant_kernels(), x, packed, bias)

    def weight_only_linear(self, x, packed, bias=None):
        return cuda_quant.weight_only_linear(self._quant_kernels(), x, packed, bias)

    # ---- paged attention ----

    def decode_reads_only_used_blocks(self, block_size: int, dtype: torch.dtype) -> bool:
        """Whether decode attention reads only each sequence's own blocks (flash_attn where it
        applies, our Triton kernel) rather than the reference's matmul over the block table's whole
        width."""
        flash = self._flash is not None and block_size % FLASH_BLOCK_MULTIPLE == 0 \
            and dtype in HALF_DTYPES
        return flash or self._attention is not None

    def _flash_usable(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if self._flash is None:
            return False
        block_size = k_cache.shape[1]
        why = None
        if block_size % FLASH_BLOCK_MULTIPLE:
            why = (
                f"kvcache_block_size={block_size} is not a multiple of {FLASH_BLOCK_MULTIPLE} "
                "(flash_attn's paged "
                f"KV cache needs it; kvcache_block_size=None picks 256)")
        elif q.dtype not in HALF_DTYPES or k_cache.dtype != q.dtype:
            why = f"flash_attn takes float16 / bfloat16, the model runs {q.dtype}"
        if why is None:
            return True
        if why not in self._warned:
            self._warned.add(why)
            logger.warning(
                "ops[cuda]: paged attention runs %s, not flash_attn: %s",
                "our Triton kernel" if self._attention is not None else "the pure-torch reference",
                why)
        return False

    def paged_attention(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
        # T == B: each sequence brings exactly one token. Shapes alone decide it, so the decode
        # branch stays sync-free.
        decode_only = q.shape[0] == seq_lens.shape[0]
        if self._flash_usable(q, k_cache):
            if decode_only:
                return self._flash_decode(q, k_cache, v_cache, seq_lens, block_tables, scale)
            return self._flash_varlen(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                      scale)
        if self._attention is not None:
            return self._attention.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens,
                                                   block_tables, scale)
        if decode_only:  # no Triton (warned at start): the sync-free gather, then the reference
            return decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale)
        return reference.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                         scale)

    def _flash_decode(self, q, k_cache, v_cache, seq_lens, block_tables, scale):
        """One query per sequence as flash_attn_with_kvcache's [B, 1, heads, D] over the paged
        cache. Only the first ceil(seq_len / block_size) block ids of each row are read, so the -1
        padding (and a CUDA graph's empty rows, seq_len 0, whose output is zero) is never
        dereferenced."""
        out = self._flash.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                                  cache_seqlens=seq_lens.to(torch.int32),
                                                  block_table=block_tables.to(torch.int32),
                                                  softmax_scale=scale, causal=True)
        return out.squeeze(1)

    def _flash_varlen(self, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
        """Prefill chunks, prefix hits and decodes in one call: flash_attn's causal mask is
        bottom-right aligned, which is the reference's "a chunk's queries are its sequence's last
        tokens"."""
        cu_k, max_q, max_k = self._step.get(cuda_attention.paged_meta, cu_seqlens_q, seq_lens)
        return self._flash.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q.to(torch.int32),
                                                  cu_k, max_q, max_k, softmax_scale=scale,
                                                  causal=True,
                                                  block_table=block_tables.to(torch.int32))

    # ---- KV caches in another dtype (kv_cache_dtype): kv_cache.py ----

    def _quantized_cache_kernels(self):
        """(the quantizing cache write, paged attention over stored rows), checked against the
        reference on first use, or None (logged once): then the reference writes and reads such
        caches."""
        device = torch.device(self.device_type)
        return self._triton.get("quantized_kv_cache",
                                lambda: cuda_kv_cache.checked_quantized_cache(device),
                                "compressed KV cache kernels", "a compressed KV cache is written "
                                "and read by the pure-torch reference")

    @property
    def kv_cache_kernels(self) -> tuple:
        return COMPRESSED_KV_DTYPES if self._quantized_cache_kernels() is not None else ()

    def store_quantized_kvcache(self, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        kernels = self._quantized_cache_kernels()
        if kernels is None:
            return super().store_quantized_kvcache(key, value, k_cache, v_cache, k_scale, v_scale,
                                                   slot_mapping)
        kernels[0](key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)

    def quantized_paged_attention(self, q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q,
                                  seq_lens, block_tables, scale):
        kernels = self._quantized_cache_kernels()
        if kernels is None:
            return super().quantized_paged_attention(q, k_cache, v_cache, k_scale, v_scale,
                                                     cu_seqlens_q, seq_lens, block_tables, scale)
        return kernels[1](q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, k_scale,
                          v_scale)

    # ---- vision tower attention ----

    def varlen_attention(self, q, k, v, cu_seqlens, scale):
        """Bidirectional attention within each packed segment: flash_attn_varlen_func (causal=False)
        when installed and the dtype is half, else our Triton kernel (every segment in one launch),
        else the reference (SDPA per segment)."""
        if self._flash is None or q.dtype not in HALF_DTYPES:
            if self._attention is not None:
                return self._attention.varlen_attention(q, k, v, cu_seqlens, scale)
            return reference.varlen_attention(q, k, v, cu_seqlens, scale)
        cu = cu_seqlens.to(torch.int32)
        max_len = self._varlen_step.get(max_segment, cu_seqlens)
        return self._flash.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len,
                                                  softmax_scale=scale, causal=False)
