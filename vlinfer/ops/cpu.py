"""Our compiled CPU kernels (kernels/cpu/paged_ops.cpp), built on first use with torch's extension builder and
cached under torch's extension folder. Prefill chunks stay on the reference (SDPA is compute-bound and good
there); decode attention, the cache write, rotary, the norms and SiLU-and-multiply run the kernels. The norms and
the activation are memory-bound passes the reference spreads over five to seven tensor ops each."""
import logging
import os

import torch

from vlinfer.ops import reference

logger = logging.getLogger("vlinfer")
NAME = "cpu-compiled"
SOURCE = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "cpu", "paged_ops.cpp")

_ext = None


def load():
    """Compile (first time on a machine) and import the extension; raises when that is impossible."""
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load as load_extension
        source = os.path.abspath(SOURCE)
        if not os.path.exists(source):
            raise FileNotFoundError(f"kernel source {source} is missing (vlinfer must run from its source tree)")
        flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
        _ext = load_extension("vlinfer_cpu_kernels", [source], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              verbose=False)
    return _ext


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    _ext.store_kvcache(key, value, k_cache, v_cache, slot_mapping)


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
    reference.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out)
    return out


def apply_rotary(q, k, cos, sin):
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    _ext.rotary_inplace(q, cos, sin)
    _ext.rotary_inplace(k, cos, sin)
    return q, k


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
