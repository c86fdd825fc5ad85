"""Our compiled CPU kernels (kernels/cpu/paged_ops.cpp, attention_bf16.cpp), built on first use with torch's
extension builder and cached under torch's extension folder, plus oneDNN's prepacked linear for every projection.
Decode attention, the cache write, rotary, the norms, SiLU-and-multiply and tanh GELU run the kernels; the norms and
activations are memory-bound passes the reference spreads over several tensor ops each.

Attention in bfloat16 on CPUs with AVX512-BF16 (prefill chunks, decode, the vision tower) runs our vdpbf16ps
kernels: torch's SDPA CPU kernel reaches about a third of this CPU's bf16 matmul rate on these shapes without AMX.
In float32, prefill and vision attention stay on SDPA, which is exact against transformers.

Linear layers: torch's F.linear re-lays out the weight for oneDNN (bf16) or runs MKL (float32) on every call;
prepare_weights() converts each projection's weight once into oneDNN's blocked layout (an opaque mkldnn tensor
that replaces the parameter, so memory does not grow; a tied LM head gets a packed copy). Measured here: 1.2-1.3x
on decode-sized matmuls (32 rows), 2x in float32, 1.05-1.15x at prefill sizes; bit-identical to F.linear in
bfloat16."""
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from vlinfer.ops import reference

logger = logging.getLogger("vlinfer")
NAME = "cpu-compiled"
SOURCES = [os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "cpu", name)
           for name in ("paged_ops.cpp", "attention_bf16.cpp")]

_ext = None


def load():
    """Compile (first time on a machine) and import the extension; raises when that is impossible."""
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load as load_extension
        sources = [os.path.abspath(source) for source in SOURCES]
        for source in sources:
            if not os.path.exists(source):
                raise FileNotFoundError(f"kernel source {source} is missing (vlinfer must run from its source tree)")
        flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
        _ext = load_extension("vlinfer_cpu_kernels", sources, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              verbose=False)
        if _ext.bf16_attention_available():
            logger.info("ops[cpu]: bf16 attention kernels built (AVX512-BF16): decode, prefill, vision")
        else:
            logger.info("ops[cpu]: this CPU has no AVX512-BF16; bf16 prefill and vision attention run SDPA, "
                        "decode the generic kernel")
    return _ext


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    _ext.store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def _bf16_attention(q) -> bool:
    """Whether attention_bf16.cpp's flash kernel takes these queries: bf16 only (in float32 SDPA is exact against
    transformers), an even head_dim up to 128 (keys are packed as bf16 pairs), and a build with AVX512-BF16."""
    return (q.dtype == torch.bfloat16 and q.shape[-1] <= 128 and q.shape[-1] % 2 == 0
            and _ext.bf16_attention_available())


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    # The kernel reads int32 metadata; the model runner already builds it so, other callers may not.
    seq_lens, block_tables = seq_lens.to(torch.int32), block_tables.to(torch.int32)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    decode = q_lens == 1
    if bool(decode.all()):
        return _ext.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    if bool(decode.any()):
        rows = decode.nonzero().squeeze(1)
        token_index = cu_seqlens_q[rows]
        out[token_index] = _ext.paged_decode_attention(q[token_index], k_cache, v_cache, block_tables[rows],
                                                       seq_lens[rows], scale)
    if _bf16_attention(q):
        _ext.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out)
    else:  # float32 (SDPA is exact there), or no AVX512-BF16 (logged at load)
        reference.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out)
    return out


def apply_rotary(q, k, cos, sin):
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    _ext.rotary_inplace(q, cos, sin)
    _ext.rotary_inplace(k, cos, sin)
    return q, k


def gelu_tanh(x):
    if not x.is_contiguous():
        return reference.gelu_tanh(x)
    return _ext.gelu_tanh_(x)


def varlen_attention(q, k, v, cu_seqlens, scale):
    if not _bf16_attention(q):
        return reference.varlen_attention(q, k, v, cu_seqlens, scale)
    return _ext.vision_attention(q, k, v, cu_seqlens.cpu(), scale)


def rms_norm(x, weight, eps):
    if weight.dtype != x.dtype:  # the reference then promotes the output; the kernel writes x's dtype only
        return reference.rms_norm(x, weight, eps)
    return _ext.rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    if not (weight.dtype == x.dtype == residual.dtype) or x.dim() != 2:
        return reference.add_rms_norm(x, residual, weight, eps)
    out, residual = _ext.add_rms_norm(x, residual, weight, eps)
    return out, residual


def silu_and_mul(x):
    if x.dim() != 2:
        return reference.silu_and_mul(x)
    return _ext.silu_and_mul(x)


# dtypes whose prepacked linear oneDNN runs here (bf16 needs AVX512-BF16 or AMX, checked at packing time)
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def linear(x, weight, bias=None):
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def prepare_weights(model: nn.Module) -> None:
    """Pack every vlinfer linear layer's weight into oneDNN's layout, in place of the parameter. Logged either way:
    a model that stays on F.linear says why."""
    from vlinfer.layers.embedding import ParallelLMHead
    from vlinfer.layers.linear import LinearBase
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and not m.weight.is_mkldnn]
    heads = [m for m in model.modules()
             if isinstance(m, ParallelLMHead) and not m.weight.is_mkldnn and m.packed_weight is None]
    if not layers and not heads:
        return
    dtype = (layers or heads)[0].weight.dtype
    if not torch.backends.mkldnn.is_available():
        logger.warning("ops[cpu]: oneDNN unavailable in this torch build; linear layers run F.linear")
        return
    if dtype not in PACKED_DTYPES or (dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        logger.info("ops[cpu]: no prepacked linear for %s on this CPU; linear layers run F.linear", dtype)
        return
    for layer in layers:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, None)
        layer.weight = nn.Parameter(packed, requires_grad=False)  # the plain weight is freed with the old one
    logger.info("ops[cpu]: %d linear weights prepacked for oneDNN (%s)", len(layers), dtype)
    _pack_lm_heads(model, heads)


def _pack_lm_heads(model: nn.Module, heads: list) -> None:
    """The logits matmul on a packed weight too (Qwen3-VL-2B's 151936-token head, 32-row decode steps: 59 -> 43 ms
    per step, measured in the image benchmark's workload). A head tied to the embedding keeps its plain rows for
    the lookups, so it gets a packed copy, logged with its size; an untied head's weight is replaced."""
    from vlinfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    embeddings = [m.weight for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    for head in heads:
        packed = torch.ops.mkldnn._reorder_linear_weight(head.weight.data, None)
        if any(head.weight is w for w in embeddings):
            head.packed_weight = packed
            logger.info("ops[cpu]: LM head tied to the embedding: a oneDNN-packed copy for the logits matmul "
                        "(+%.0f MiB)", head.weight.numel() * head.weight.element_size() / 2 ** 20)
        else:
            head.weight = nn.Parameter(packed, requires_grad=False)
