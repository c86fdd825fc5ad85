"""Pure-torch definitions of the quantized linear ops. Device implementations (ops/npu/backend.py on
torch_npu, ops/cuda/backend.py on our Triton kernels, ops/cpu/backend.py) must match these; tests
compare each against them.

Written by helper Q-C (msModelSlim, NPU, CUDA). To helper Q-A: these are the W8A8 / W8A16 / W4A16
definitions the NPU and CUDA ops are tested against. If your framework needs another signature,
adapt here (and tell Q-C) rather than adding a second definition of the same math.

Canonical layouts (what `pack_quantized_linear` receives from a layer, and what the reference
keeps):
- `weight`: int8 [N, K] holding the integer values (int4 values too, one per byte, in [-8, 7] or [0,
  15]).
- `weight_scale`: float [N, G] with G = K / group_size (G = 1: per output channel). `weight_zero`:
  same shape or
  None; the weight means (weight - weight_zero) * weight_scale.
- W8A8 dynamic: activations quantized per token (row), symmetric: scale = max|x_row| / 127, x_q =
  round(x / scale)
  (round half to even), clamped to [-128, 127]; y = (x_q @ weight^T) * weight_scale * x_scale +
  bias.
- W8A8 static (msModelSlim's formula, quant_model_weight description): x_q = clamp(round(x /
  input_scale +
  input_offset)); y = (x_q @ weight^T + quant_bias) * deq_scale + bias. msModelSlim folds the float
  bias and the
  offset correction into quant_bias (int32); compressed-tensors static maps to quant_bias = -zp *
  weight.sum(1),
  deq_scale = input_scale * weight_scale.
Integer products are accumulated exactly (float64 holds every int8 x int8 sum of K < 2**37 terms
exactly), then
scaled in float32, then cast to x's dtype: the order a device's int32 accumulator + float epilogue
follows.

`pack_quantized_linear(scheme, tensors)` lets an implementation lay tensors out for its kernels once
after loading (transposed, packed, cast); the three ops receive what it returned. The reference
keeps the canonical layout.
"""
import torch
import torch.nn.functional as F

SCHEMES = ("w8a8_dynamic", "w8a8_static", "w8a16", "w4a16")
INT8_MIN, INT8_MAX = -128, 127


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (x_q int8 shaped like x, scale float32 [rows]). An all-zero row has
    scale 0 and quantizes to zeros."""
    xf = x.float()
    scale = xf.abs().amax(-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    x_q = torch.round(xf / safe[..., None]).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)
    return x_q, scale


def quantize_per_tensor(x: torch.Tensor, input_scale: torch.Tensor,
                        input_offset: torch.Tensor) -> torch.Tensor:
    """Static int8: clamp(round(x / input_scale + input_offset)), scale and offset one value each.
    """
    scale = input_scale.float().reshape(-1)[0]
    offset = input_offset.float().reshape(-1)[0]
    return torch.round(x.float() / scale + offset).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def int_matmul(x_q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Exact x_q [M, K] @ weight[N, K]^T of int8 values, as float64 (exact for any realistic K)."""
    return x_q.double() @ weight.double().t()


def w8a8_dynamic_linear(x: torch.Tensor, packed: dict,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """packed: weight int8 [N, K], weight_scale float [N, 1]."""
    shape = x.shape
    x_q, x_scale = quantize_per_token(x.reshape(-1, shape[-1]))
    acc = int_matmul(x_q, packed["weight"]).float()
    y = acc * packed["weight_scale"].float().reshape(1, -1) * x_scale[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], -1)


def w8a8_static_linear(x: torch.Tensor, packed: dict,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """packed: weight int8 [N, K], input_scale [1], input_offset [1], quant_bias int32 [N],
    deq_scale float32 [N]."""
    shape = x.shape
    x_q = quantize_per_tensor(x.reshape(-1, shape[-1]), packed["input_scale"],
                              packed["input_offset"])
    acc = int_matmul(x_q, packed["weight"]) + packed["quant_bias"].double()[None, :]
    y = acc.float() * packed["deq_scale"].float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], -1)


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_zero: torch.Tensor | None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(weight - zero) * scale in float32, per channel (scale [N, 1]) or per group of K / G columns
    ([N, G])."""
    n, k = weight.shape
    groups = weight_scale.reshape(n, -1).shape[1]
    if k % groups:
        raise ValueError(f"weight [{n}, {k}] cannot split into {groups} groups per row")
    w = weight.float().reshape(n, groups, k // groups)
    if weight_zero is not None:
        w = w - weight_zero.float().reshape(n, groups, 1)
    return (w * weight_scale.float().reshape(n, groups, 1)).reshape(n, k).to(dtype)


def weight_only_linear(x: torch.Tensor, packed: dict,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A16 / W4A16. packed: weight int8 [N, K] values, weight_scale [N, G], weight_zero [N, G] or
    None. The weight is dequantized to x's dtype and multiplied as a dense one."""
    w = dequantize_weight(packed["weight"], packed["weight_scale"], packed.get("weight_zero"),
                          x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def pack_quantized_linear(scheme: str, tensors: dict) -> dict:
    """The reference keeps the canonical layout; it only checks the scheme and the tensors' shapes.
    """
    check_quantized_tensors(scheme, tensors)
    return dict(tensors)


def check_quantized_tensors(scheme: str, tensors: dict) -> None:
    """Raise a ValueError naming the tensor when a canonical tensor set is malformed."""
    if scheme not in SCHEMES:
        raise ValueError(
            f"unknown quantization scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    weight = tensors.get("weight")
    if weight is None or weight.dim() != 2 or weight.dtype != torch.int8:
        raise ValueError(f"{scheme}: weight must be int8 [N, K], got "
                         f"{None if weight is None else (weight.dtype, tuple(weight.shape))}")
    n, k = weight.shape
    need = {
        "w8a8_dynamic": ("weight_scale", ),
        "w8a8_static": ("input_scale", "input_offset", "quant_bias", "deq_scale"),
        "w8a16": ("weight_scale", ), "w4a16": ("weight_scale", )
    }[scheme]
    for name in need:
        if tensors.get(name) is None:
            raise ValueError(f"{scheme}: missing tensor {name}")
    if scheme == "w8a8_dynamic" and tensors["weight_scale"].numel() != n:
        raise ValueError(
            f"{scheme}: weight_scale has {tensors['weight_scale'].numel()} values for {n} rows")
    if scheme == "w8a8_static":
        for name in ("input_scale", "input_offset"):
            if tensors[name].numel() != 1:
                raise ValueError(
                    f"{scheme}: {name} must hold one value, got shape {tuple(tensors[name].shape)}")
        for name in ("quant_bias", "deq_scale"):
            if tensors[name].numel() != n:
                raise ValueError(
                    f"{scheme}: {name} has {tensors[name].numel()} values for {n} rows")
    if scheme in ("w8a16", "w4a16"):
        scale = tensors["weight_scale"]
        if scale.numel() % n or k % (scale.numel() // n):
            raise ValueError(
                f"{scheme}: weight_scale {tuple(scale.shape)} does not split weight [{n}, {k}] "
                "into "
                "per-channel or per-group scales")
        zero = tensors.get("weight_zero")
        if zero is not None and zero.numel() != scale.numel():
            raise ValueError(
                f"{scheme}: weight_zero {tuple(zero.shape)} does not match weight_scale "
                f"{tuple(scale.shape)}")
