"""W8A16 / W4A16 for CUDA in Triton: x [M, K] (fp16 / bf16 / fp32) times a weight dequantized tile
by tile, (q - zero) * scale per output channel or per group of K rows, accumulated in float32.

Weight layouts (made once at load by vlinfer/ops/cuda/quant.py, K leading so a tile load is one run
per row):
- 8-bit: int8 [K, N], the signed values.
- 4-bit: int32 [K / 8, N]: word (j, n) holds rows 8j..8j+7 of column n, row 8j+i in bits 4i..4i+3
  (low first),
  each value stored as it is in the checkpoint's [0, 15] (the zero point says where 0 lies;
  symmetric int4 is
  value + 8 with zero 8).
- scale and zero: float32 [G, N], G = K / group_size (G = 1: per channel); zero absent = 0.
The dequantized tile is cast to x's dtype before the dot, as the reference dequantizes the weight to
x's dtype.
Under the Triton interpreter (tests on CPU) the tiles are multiplied in float32: the interpreter of
Triton 3.8 gives
wrong results for tl.dot on bfloat16 tiles (found here: off by 1e10). Both operands are exact in
float32 after
the cast to x's dtype, so this changes only the summation, not what is summed; on a GPU, 16-bit
tiles go to the
tensor cores as they are.

Loaded by file path (triton/ is not a package); tested under the Triton interpreter on CPU tensors.
"""
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, stride_x,
                        group_size, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                        HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    # not tl.zeros: see int8_gemm.py on the interpreter
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_mask = ks < K
        x = tl.load(x_ptr + rm[:, None] * stride_x + ks[None, :],
                    mask=(rm[:, None] < M) & k_mask[None, :], other=0.0)
        tile_mask = k_mask[:, None] & n_mask[None, :]
        if BITS == 8:
            q = tl.load(w_ptr + ks[:, None].to(tl.int64) * N + rn[None, :], mask=tile_mask,
                        other=0).to(tl.float32)
        else:
            word = tl.load(w_ptr + (ks[:, None] // 8).to(tl.int64) * N + rn[None, :],
                           mask=tile_mask, other=0)
            q = ((word >> ((ks[:, None] % 8) * 4)) & 0xF).to(tl.float32)
        groups = (ks[:, None] // group_size).to(tl.int64) * N + rn[None, :]
        if HAS_ZERO:
            q = q - tl.load(zero_ptr + groups, mask=tile_mask, other=0.0)
        w = (q * tl.load(scale_ptr + groups, mask=tile_mask, other=0.0)).to(x.dtype)
        # no TF32
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), out_dtype=tl.float32,
                      input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & n_mask[None, :])


def weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, bits: int, scale: torch.Tensor,
                       zero: torch.Tensor | None, group_size: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized weight -> [M, N] in x's dtype. weight: int8 [K, N] (bits 8) or int32
    [K/8, N] (bits 4); scale / zero float32 [K / group_size, N]; bias [N] or None."""
    m, k = x.shape
    n = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _weight_only_kernel[grid](x, weight, scale, zero if zero is not None else scale,
                              bias if bias is not None else scale, out, m, n, k, x.stride(0),
                              group_size, BITS=bits, HAS_ZERO=zero is not None, HAS_BIAS=bias
                              is not None, DOT_DTYPE=_dot_dtype(x.dtype), BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def _dot_dtype(dtype: torch.dtype):
    if dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
