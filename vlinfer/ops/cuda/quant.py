"""Quantized linears on CUDA: our Triton kernels (triton/int8_gemm.py for W8A8, weight_only_gemm.py
for W8A16 / W4A16) behind the definitions in ops/reference/quant.py. CudaOps' quantized-op methods
are thin wrappers.

- W8A8 dynamic: per-token quantize kernel, then the int8 GEMM (int32 accumulator) with weight_scale
  per column and
  the token scales per row. W8A8 static: per-tensor quantize kernel, the GEMM adds quant_bias,
  scales by deq_scale.
- W8A16 / W4A16: the weight stays int8 [K, N] (8-bit) or nibble-packed int32 [K/8, N] (4-bit) and is
  dequantized
  tile by tile inside the GEMM.
- Weights are laid out once at load (`pack`); nothing is cached to disk.
- Kernels that do not load or fail their load-time check on this machine (QuantKernels raises;
  CudaOps loads it through loader.TritonKernels): a warning, and every quantized linear runs the
  reference (dequantize + matmul) on the device.
Not run on a GPU yet: tests/ops/cuda/test_quantized_cuda_ops.py runs the kernels under the Triton
interpreter on CPU tensors.
"""
import torch

from vlinfer.ops.cuda.loader import load_triton_module
from vlinfer.ops.reference import quant as quant_reference


class QuantKernels:
    """The loaded Triton modules, checked on tiny problems against the reference on `device`."""

    def __init__(self, device: torch.device):
        self.int8 = load_triton_module("int8_gemm")
        self.weight_only = load_triton_module("weight_only_gemm")
        self._check(device)

    def _check(self, device):
        g = torch.Generator().manual_seed(0)
        n, k = 24, 40  # not multiples of the tiles: masks at every edge
        weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        x = torch.randn(3, k, generator=g)
        dynamic = {"weight": weight, "weight_scale": torch.rand(n, 1, generator=g) * 0.01}
        static = {
            "weight": weight, "input_scale": torch.tensor([0.02]),
            "input_offset": torch.tensor([2.0]),
            "quant_bias": torch.randint(-99, 99, (n, ), generator=g, dtype=torch.int32),
            "deq_scale": torch.rand(n, generator=g) * 1e-3
        }
        four_bit = {
            "weight": torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8),
            "weight_scale": torch.rand(n, 5, generator=g), "weight_zero": torch.full((n, 5), 8.0)
        }
        cases = (("w8a8_dynamic", dynamic, w8a8_dynamic_linear),
                 ("w8a8_static", static, w8a8_static_linear), ("w4a16", four_bit,
                                                               weight_only_linear))
        for scheme, tensors, op in cases:
            tensors = {key: value.to(device) for key, value in tensors.items()}
            ours = op(self, x.to(device), pack(self, scheme, tensors), None)
            ref = getattr(quant_reference, op.__name__)(x.to(device), tensors)
            err = ((ours - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-5:
                raise RuntimeError(
                    f"the Triton {scheme} kernel is off from the reference by {err:.3g}")


def pack(kernels: QuantKernels | None, scheme: str, tensors: dict) -> dict:
    """The canonical tensors laid out for the kernels (weights [K, N], scales float32 [G, N]); with
    no kernels, the reference's layout."""
    if kernels is None:
        return quant_reference.pack_quantized_linear(scheme, tensors)
    quant_reference.check_quantized_tensors(scheme, tensors)
    weight = tensors["weight"]
    n, k = weight.shape
    packed = {"scheme": scheme, "triton": True}
    if scheme == "w8a8_dynamic":
        packed.update(weight=weight.t().contiguous(),
                      weight_scale=tensors["weight_scale"].float().reshape(n))
    elif scheme == "w8a8_static":
        packed.update(weight=weight.t().contiguous(),
                      input_scale=tensors["input_scale"].float().reshape(1),
                      input_offset=tensors["input_offset"].float().reshape(1),
                      quant_bias=tensors["quant_bias"].to(torch.int32).reshape(n).contiguous(),
                      deq_scale=tensors["deq_scale"].float().reshape(n).contiguous())
    else:
        scale = tensors["weight_scale"].float().reshape(n, -1)
        groups = scale.shape[1]
        zero = tensors.get("weight_zero")
        zero = None if zero is None else zero.float().reshape(n, groups)
        bits = 4 if scheme == "w4a16" and k % 8 == 0 else 8
        if bits == 4:
            low, high = int(weight.min()), int(weight.max())  # once, at load
            if low < 0:  # signed int4 [-8, 7]: store value + 8 and move the zero point with it
                if low < -8 or high > 7:
                    raise ValueError(f"w4a16: weight values [{low}, {high}] do not fit signed int4")
                weight = weight + 8
                zero = torch.full_like(scale, 8.0) if zero is None else zero + 8.0
            elif high > 15:
                raise ValueError(f"w4a16: weight values [{low}, {high}] do not fit unsigned int4")
            nibbles = weight.t().to(torch.int64).reshape(k // 8, 8, n)
            shifts = (torch.arange(8, device=weight.device, dtype=torch.int64) * 4).reshape(1, 8, 1)
            # bit 31 wraps into the sign: intended
            packed_weight = (nibbles << shifts).sum(1).to(torch.int32)
        else:
            packed_weight = weight.t().contiguous()
        packed.update(weight=packed_weight, bits=bits, scale=scale.t().contiguous(),
                      zero=None if zero is None else zero.t().contiguous(), group_size=k // groups,
                      out_features=n)
    return packed


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def w8a8_dynamic_linear(kernels, x, packed, bias):
    if not packed.get("triton"):
        return quant_reference.w8a8_dynamic_linear(x, packed, bias)
    rows = _rows(x)
    x_q, x_scale = kernels.int8.quantize_per_token(rows)
    y = kernels.int8.int8_matmul(x_q, packed["weight"], packed["weight_scale"], x.dtype,
                                 row_scale=x_scale, bias=bias)
    return y.reshape(*x.shape[:-1], -1)


def w8a8_static_linear(kernels, x, packed, bias):
    if not packed.get("triton"):
        return quant_reference.w8a8_static_linear(x, packed, bias)
    rows = _rows(x)
    x_q = kernels.int8.quantize_per_tensor(rows, packed["input_scale"], packed["input_offset"])
    y = kernels.int8.int8_matmul(x_q, packed["weight"], packed["deq_scale"], x.dtype,
                                 quant_bias=packed["quant_bias"], bias=bias)
    return y.reshape(*x.shape[:-1], -1)


def weight_only_linear(kernels, x, packed, bias):
    if not packed.get("triton"):
        return quant_reference.weight_only_linear(x, packed, bias)
    y = kernels.weight_only.weight_only_matmul(_rows(x), packed["weight"], packed["bits"],
                                               packed["scale"], packed["zero"],
                                               packed["group_size"], bias)
    return y.reshape(*x.shape[:-1], -1)
