"""W8A8 for CUDA in Triton: int8 activations x int8 weights with an int32 accumulator and a float
epilogue.

- `quantize_per_token`: whole rows per program: scale = max|x| / 127, codes = round(x / scale), half
  to even, as
  vlinfer/ops/reference/quant.py defines it (dynamic W8A8).
- `quantize_per_tensor`: static W8A8, codes = clamp(round(x / input_scale + input_offset)).
- `int8_matmul`: x_q int8 [M, K] @ w int8 [K, N] (the weight transposed once at load, so K is the
  leading dim of
  each tile load), then (acc + quant_bias) * col_scale [* row_scale] + bias, stored in the output
  dtype. Dynamic
  W8A8: col_scale = weight_scale, row_scale = the token scales. Static: quant_bias and col_scale =
  deq_scale.
Divisions use div_rn (IEEE round-to-nearest): Triton's `/` on fp32 is an approximate division on
NVIDIA GPUs, which
would move codes at rounding ties away from the reference.

Loaded by file path by vlinfer/ops/cuda/loader.py (triton/ is not a package; see
store_kvcache.py). Runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1), which is
how tests/ops/cuda/test_quantized_cuda_ops.py checks it.
"""
import torch
import triton
import triton.language as tl


# The kernels call no jit helpers of triton.language (tl.zeros, tl.zeros_like, tl.max, tl.cdiv): the
# interpreter cannot run those when triton was imported before TRITON_INTERPRET was set (a test
# process that imported it for another kernel first), so zeros come from tl.full and the row maximum
# from tl.reduce with triton's own combine (which the interpreter reduces with numpy;
# cuda/triton/paged_attention.py says the same).
@triton.jit
def _round_half_even(v):
    r = tl.floor(v + 0.5)
    # A tie (v = n + 0.5) rounded up to an odd number goes down to the even one.
    tie = (r - v) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_x, BLOCK_M: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max) / 127.0
    safe = tl.where(scale > 0, scale, 1.0)
    q = _round_half_even(
        tl.math.div_rn(x,
                       tl.full((BLOCK_M, BLOCK_K), 0.0, tl.float32) + safe[:, None]))
    q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < M)


@triton.jit
def _quantize_per_tensor_kernel(x_ptr, q_ptr, scale_ptr, offset_ptr, M, K, stride_x,
                                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)
    offset = tl.load(offset_ptr).to(tl.float32)
    q = _round_half_even(
        tl.math.div_rn(x,
                       tl.full((BLOCK_M, BLOCK_K), 0.0, tl.float32) + scale) + offset)
    q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q.to(tl.int8), mask=mask)


@triton.jit
def _int8_matmul_kernel(a_ptr, b_ptr, out_ptr, col_scale_ptr, row_scale_ptr, qbias_ptr, bias_ptr, M,
                        N, K, HAS_ROW_SCALE: tl.constexpr, HAS_QBIAS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * K + ks[None, :],
                    mask=(rm[:, None] < M) & (ks[None, :] < K), other=0)
        b = tl.load(b_ptr + ks[:, None].to(tl.int64) * N + rn[None, :],
                    mask=(ks[:, None] < K) & (rn[None, :] < N), other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    n_mask = rn < N
    if HAS_QBIAS:
        acc += tl.load(qbias_ptr + rn, mask=n_mask, other=0)[None, :]
    y = acc.to(tl.float32) * tl.load(col_scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_ROW_SCALE:
        y = y * tl.load(row_scale_ptr + rm, mask=rm < M, other=0.0)[:, None]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & n_mask[None, :])


def _rows_per_program(block_k: int) -> int:
    # A tile of about 4096 elements: whole rows of a wide layer one at a time, several rows of a
    # narrow one.
    return max(1, min(64, 4096 // block_k))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (codes int8 [M, K], scales float32 [M])."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    block_k = triton.next_power_of_2(k)
    block_m = _rows_per_program(block_k)
    if m:
        _quantize_per_token_kernel[(triton.cdiv(m, block_m), )](x, q, scale, m, k, x.stride(0),
                                                                BLOCK_M=block_m, BLOCK_K=block_k)
    return q, scale


def quantize_per_tensor(x: torch.Tensor, input_scale: torch.Tensor,
                        input_offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> codes int8 [M, K] with one scale and offset (float32 tensors of one element)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    block_k = min(1024, triton.next_power_of_2(k))
    block_m = _rows_per_program(block_k)
    if m:
        _quantize_per_tensor_kernel[(triton.cdiv(m, block_m), triton.cdiv(k, block_k))](
            x, q, input_scale, input_offset, m, k, x.stride(0), BLOCK_M=block_m, BLOCK_K=block_k)
    return q


def int8_matmul(x_q: torch.Tensor, weight_kn: torch.Tensor, col_scale: torch.Tensor,
                out_dtype: torch.dtype, row_scale: torch.Tensor | None = None,
                quant_bias: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x_q [M, K] @ weight_kn [K, N] + quant_bias) * col_scale [* row_scale] + bias, as out_dtype
    [M, N]. col_scale / row_scale float32, quant_bias int32, all contiguous."""
    m, k = x_q.shape
    n = weight_kn.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    # tl.dot needs >= 16; decode batches are small
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    dummy = col_scale  # unused pointer arguments (their branch is compiled out)
    _int8_matmul_kernel[grid](x_q.contiguous(), weight_kn, out, col_scale,
                              row_scale if row_scale is not None else dummy,
                              quant_bias if quant_bias is not None else dummy,
                              bias if bias is not None else dummy, m, n, k, HAS_ROW_SCALE=row_scale
                              is not None, HAS_QBIAS=quant_bias is not None, HAS_BIAS=bias
                              is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
