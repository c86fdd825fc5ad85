"""The emulated torch_npu's quantization operators (registered on FakeTorchNpu by
tests/fakes/fake_torch_npu.py).

Written from the documented contracts, not from vlinfer/ops/reference/quant.py: the shared
quantization note (quantization.md) §3 (torch-npu 2.14 docstrings: npu_dynamic_quant OPD:4655,
npu_quantize OPD:11343, npu_quant_matmul OPD:4953, npu_weight_quant_batchmatmul OPD:5410) plus the
CANN formulas behind them:
- aclnnQuantMatmulV4/V5: int32 bias: out = (x1 @ x2 + bias) * scale [* pertoken_scale]; bf16/fp32
  bias: out =
  x1 @ x2 * scale [* pertoken_scale] + bias.
- aclnnWeightQuantBatchMatmulV2/V3: y = x @ ANTIQUANT(weight) + bias, ANTIQUANT(weight) = (weight +
  antiquant_offset) * antiquant_scale: the offset is added, which is why callers pass minus the zero
  point.
Each op checks dtypes and shapes as documented and raises FakeNpuError on a call the device would
reject. Integer
products are exact (float64 sums of int8 products), scaling is float32, results cast to the output
dtype.
Interpretation (the docs do not say): rounding is half to even, as torch.round; an all-zero row of
npu_dynamic_quant gets scale 0 and zeros.
"""
import torch

from fake_torch_npu import HALF, _require

INT8_RANGE = (-128, 127)
MAX_DIM = 65535  # last dims of the quantized matmuls (OPD:4953, OPD:5410)


def _dynamic_quant(module, x, *, smooth_scales=None, group_index=None, dst_type=None):
    """OPD:4655: per-token symmetric int8, scale = rowmax(|x|) / 127 (fp32, x.shape[:-1]); x
    fp16/bf16, ndim > 1."""
    _require(x.dtype in HALF, f"npu_dynamic_quant takes float16/bfloat16 x, got {x.dtype}")
    _require(x.dim() > 1, "npu_dynamic_quant needs x with ndim > 1")
    if group_index is not None:
        raise NotImplementedError("group_index (MoE) is not emulated")
    _require(dst_type in (None, torch.int8), f"dst_type {dst_type} is not emulated (int8 only)")
    xf = x.float()
    if smooth_scales is not None:
        _require(smooth_scales.shape == x.shape[-1:], "smooth_scales must be [H]")
        xf = xf * smooth_scales.float()
    scale = xf.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(xf / safe[..., None]).clamp_(*INT8_RANGE).to(torch.int8)
    return y, scale


def _quantize(module, input, scales, zero_points, dtype, axis=1, div_mode=True):
    """OPD:11343: div_mode=True: x / scales + zero_points, False: x * scales + zero_points; scales
    1-D, one value or one per element along axis; qint8 output (the int8 tensor torch_npu returns
    for it)."""
    _require(input.dtype in HALF + (torch.float32, ),
             f"npu_quantize takes a float input, got {input.dtype}")
    if dtype != torch.qint8:
        raise NotImplementedError(f"npu_quantize to {dtype} is not emulated (qint8 only)")
    _require(scales.dim() == 1, f"scales must be 1-D, got {tuple(scales.shape)}")
    ax = axis % input.dim()
    _require(
        scales.numel() in (1, input.shape[ax]),
        f"scales has {scales.numel()} values; expected 1 or input.shape[{axis}]={input.shape[ax]}")
    _require(zero_points is None or zero_points.shape == scales.shape,
             "zero_points must be shaped like scales")
    view = [1] * input.dim()
    view[ax] = -1
    s = scales.float().reshape(view)
    x = input.float() / s if div_mode else input.float() * s
    if zero_points is not None:
        x = x + zero_points.float().reshape(view)
    return torch.round(x).clamp_(*INT8_RANGE).to(torch.int8)


def _quant_matmul(module, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                  output_dtype=None):
    """OPD:4953: x1 int8 [..., M, K] (2-6-D), x2 int8 [K, N]; scale 1-D (1 or N) fp32/bf16;
    pertoken_scale fp32 [M]; bias int32 (added before scaling) or bf16/fp16/fp32 (after), [N];
    output_dtype fp16/bf16 here (int8 default and int32 are not emulated)."""
    _require(x1.dtype == torch.int8 and x2.dtype == torch.int8,
             f"int8 x1/x2 expected, got {x1.dtype}/{x2.dtype}")
    _require(2 <= x1.dim() <= 6 and x2.dim() == 2, "x1 must be 2-6-D and x2 [K, N]")
    k, n = x2.shape
    _require(x1.shape[-1] == k, f"x1 [.., {x1.shape[-1]}] and x2 [{k}, {n}] do not chain")
    _require(k <= MAX_DIM and n <= MAX_DIM, f"K={k}, N={n}: last dims must be <= {MAX_DIM}")
    if output_dtype is None or output_dtype in (torch.int8, torch.int32):
        raise NotImplementedError(
            f"output_dtype {output_dtype} is not emulated (float16/bfloat16 only)")
    _require(output_dtype in HALF, f"output_dtype {output_dtype} is not supported")
    _require(scale.dim() == 1 and scale.numel() in (1, n),
             f"scale must be 1-D with 1 or N={n} values, got "
             f"{tuple(scale.shape)}")
    _require(
        scale.dtype in (torch.float32, torch.bfloat16),
        f"scale {scale.dtype}: float32/bfloat16 emulated (int64 comes from npu_trans_quant_param)")
    _require(offset is None, "offset (int8 output) is not emulated")
    _require(
        pertoken_scale is not None or output_dtype == torch.bfloat16,
        "without pertoken_scale, a float32/bfloat16 scale needs bfloat16 output (float16 output "
        "takes an int64 "
        "scale from npu_trans_quant_param)")
    acc = x1.reshape(-1, k).double() @ x2.double()
    if bias is not None:
        _require(bias.dim() == 1 and bias.numel() == n,
                 f"bias must be [N={n}], got {tuple(bias.shape)}")
        _require(bias.dtype in (torch.int32, torch.bfloat16, torch.float16, torch.float32),
                 f"bias dtype {bias.dtype} is not supported")
        _require(bias.dtype != torch.float16 or output_dtype == torch.float16,
                 "a float16 bias needs float16 output")
        _require(bias.dtype != torch.bfloat16 or output_dtype == torch.bfloat16,
                 "a bfloat16 bias needs bfloat16 output")
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.double()
    y = acc.float() * scale.float()
    if pertoken_scale is not None:
        _require(pertoken_scale.dtype == torch.float32, "pertoken_scale must be float32")
        _require(pertoken_scale.shape == (y.shape[0], ),
                 f"pertoken_scale must be [M={y.shape[0]}], got "
                 f"{tuple(pertoken_scale.shape)}")
        y = y * pertoken_scale[:, None]
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    return y.to(output_dtype).reshape(*x1.shape[:-1], n)


def _weight_quant_batchmatmul(module, x, weight, antiquant_scale, antiquant_offset=None,
                              quant_scale=None, quant_offset=None, bias=None,
                              antiquant_group_size=0, inner_precise=0):
    """OPD:5410: x [M, K] fp16/bf16, weight int8 [K, N]; antiquant_scale in x's dtype, per tensor
    (1,), per channel (N,) / (1, N) or per group (ceil(K/g), N) with g a multiple of 32 in [32,
    K-1]; offset like the scale; bias fp32 with bf16 x, else x's dtype. y = x @ ((weight + offset) *
    scale) + bias."""
    _require(x.dtype in HALF and x.dim() == 2,
             f"x must be a 2-D float16/bfloat16 [M, K], got {x.dtype} "
             f"{tuple(x.shape)}")
    if weight.dtype == torch.int32:
        raise NotImplementedError(
            "int4 weights packed in int32 (npu_convert_weight_to_int4pack) are not emulated")
    _require(weight.dtype == torch.int8 and weight.dim() == 2, "weight must be int8 [K, N]")
    k, n = weight.shape
    _require(x.shape[1] == k, f"x [.., {x.shape[1]}] and weight [{k}, {n}] do not chain")
    _require(k <= MAX_DIM and n <= MAX_DIM, f"K={k}, N={n} must be <= {MAX_DIM}")
    _require(quant_scale is None and quant_offset is None, "output quantization is not emulated")
    _require(antiquant_scale.dtype == x.dtype,
             f"antiquant_scale must have x's dtype {x.dtype}, got "
             f"{antiquant_scale.dtype}")
    if antiquant_group_size:
        g = antiquant_group_size
        _require(g % 32 == 0 and 32 <= g <= k - 1,
                 f"antiquant_group_size {g} must be a multiple of 32 in [32, K-1]")
        groups = -(-k // g)
        _require(
            antiquant_scale.shape == (groups, n),
            f"per-group antiquant_scale must be ({groups}, {n}), got "
            f"{tuple(antiquant_scale.shape)}")
        rows = torch.arange(k) // g
        scale = antiquant_scale.float()[rows]
    else:
        _require(
            antiquant_scale.shape in ((1, ), (n, ), (1, n)),
            f"antiquant_scale must be (1,), ({n},) or (1, {n}), "
            f"got {tuple(antiquant_scale.shape)}")
        scale = antiquant_scale.float().reshape(1, -1)
        rows = None
    w = weight.float()
    if antiquant_offset is not None:
        _require(
            antiquant_offset.shape == antiquant_scale.shape and antiquant_offset.dtype == x.dtype,
            "antiquant_offset must be shaped and typed like antiquant_scale")
        off = antiquant_offset.float()
        w = w + (off[rows] if rows is not None else off.reshape(1, -1))
    # the dequantized weight tile is in x's dtype, accumulation in float32
    w = (w * scale).to(x.dtype)
    y = x.float() @ w.float()
    if bias is not None:
        want = torch.float32 if x.dtype == torch.bfloat16 else x.dtype
        _require(bias.dtype == want and bias.numel() == n,
                 f"bias must be {want} [N={n}], got {bias.dtype} "
                 f"{tuple(bias.shape)}")
        y = y + bias.float().reshape(1, -1)
    return y.to(x.dtype)


QUANT_OPS = {
    "npu_dynamic_quant": _dynamic_quant, "npu_quantize": _quantize,
    "npu_quant_matmul": _quant_matmul, "npu_weight_quant_batchmatmul": _weight_quant_batchmatmul
}
