"""CPU kernels for the quantized linears (definitions: ops/reference/quant.py):
- Per-channel int8 (W8A16, int8 on load, W8A8 dynamic), N a multiple of 32 and K of 4, on builds
  with AVX512-VNNI: our VNNI panels (int8_panels.py: which rows run W8A16 and which W8A8, and why).
- W8A16 per channel elsewhere (AVX2, AVX-512 without VNNI, N off the panels): our GGUF block kernel
  (csrc/gguf_blocks.cpp) at every row count, the int8 weight held as Q8_0 blocks of d = 1
  (gguf_reference.q8_0_blocks: exact) and the channel scales applied to its float32 result. Its
  activations are two int8 digits per 32 (gguf_reference.quantize_activations), integer dot products
  (VNNI, vpmaddubsw without it): each activation within 1/(127 * 512) of its block's largest, so the
  outputs stay within ~2e-5 of the largest output of the float-activation reference, far under bf16
  rounding (tests bound it at 1e-4). In memory 34 bytes per 32 weights (the blocks' fp16 ones)
  against 32. In bfloat16 compute from BF16_PANEL_ROWS rows, on CPUs with AVX512-BF16, the same
  packed weights run `int8_linear_bf16`: widened to bf16 once per call, products against the bf16
  activations as they are (no digits), as fast as the prepacked dense bf16 matmul.
- W4A16 (groups of 32..256): `aten._convert_weight_to_int4pack_for_cpu` at load (on the machine that
  runs, never cached) + `aten._weight_int4pack_mm_for_cpu`, scales and float zeros [K/g, N, 2]: w =
  (u - 8) * scale + zero with u = q + 8, zero = -zp * scale (the reference's (q - zp) * scale,
  rounded once more). Above DENSE_ROWS rows (prefill chunks) it streams the whole weight for every
  few rows and loses to dequantize + the dense matmul (oneDNN / AMX), so those calls take the
  reference path.
- W8A8 (int8 x int8) off the VNNI panels: oneDNN `onednn.qlinear_prepack` +
  `onednn.qlinear_pointwise`, only where the CPU has VNNI or AMX-INT8 (elsewhere int8 products go
  through vpmaddubsw's saturating int16 path or torch's scalar loop): the activations are quantized
  as the reference does, the matmul runs with x scale 1 and the weight scales, and the per-token
  scales multiply the rows after. Without VNNI / AMX a W8A8 layer runs as W8A16 on its int8 weight
  (activations as the W8A16 kernel holds them; logged), which is not the reference's numerics but
  the faster honest choice there.

Each layout is checked once at pack time against the reference on a small input; a kernel torch does
not take for this shape or dtype is logged and the layer keeps the reference path."""
import logging

import torch

from vlinfer.ops.cpu import int8_panels
from vlinfer.ops.reference import gguf as gguf_reference
from vlinfer.ops.reference import quant as quant_reference

logger = logging.getLogger("vlinfer")
# Rows above which int4 layers dequantize (per call) and run the dense matmul: past it int4pack
# streams the whole weight for every few rows (bench/quantized.py re-derives it; docs/benchmarks.md
# "Kernel decisions").
DENSE_ROWS = 256
# int8 per-channel layers run the block kernel at every row count in float32; bf16 activations from
# BF16_PANEL_ROWS rows run int8_linear_bf16 where the CPU has AVX512-BF16, which leads there
# (bench/quantized.py).
BF16_PANEL_ROWS = 8
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
INT4_GROUPS = (32, 64, 128, 256)
Q8_0 = 8  # ggml type id


def has_int8_dot_product() -> bool:
    """VNNI (AVX512-VNNI / AVX-VNNI) or AMX-INT8: int8 products without int16 saturation."""
    from vlinfer.platform import cpu_features
    flags = cpu_features.cpu_flags()
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


def pack(scheme: str, tensors: dict, int8_dot: bool, block_kernels, vnni_ext=None) -> dict:
    """block_kernels(): the op table's GGUF block kernels (gguf.py), built on the first call, None
    where they did not build (logged there; int8 weight-only layers then run the reference). Called
    only for a layer that runs on them, so int4 and W8A8 checkpoints never build them. vnni_ext: the
    CPU kernels' extension where it has the VNNI panels (int8_panels.py), else None."""
    packed = quant_reference.pack_quantized_linear(scheme, tensors)
    weight = packed["weight"]
    n, k = weight.shape
    policy = {"w8a16": "w8a16", "w8a8_dynamic": "w8a8"}.get(scheme)
    scale = packed.get("weight_scale")
    if (vnni_ext is not None and policy is not None and packed.get("weight_zero") is None
            and scale is not None and scale.numel() == n and int8_panels.fits(n, k)):
        packed["cpu"] = int8_panels.pack(weight, scale, policy, vnni_ext)
        return packed
    try:
        if scheme in ("w8a16", "w4a16") or (scheme.startswith("w8a8") and not int8_dot):
            kernel = _pack_weight_only(scheme, packed, n, k, block_kernels)
            if scheme.startswith("w8a8") and kernel is not None:
                logger.info(
                    "ops[cpu]: no VNNI / AMX-INT8 on this CPU: W8A8 layer [%d x %d] runs as W8A16 "
                    "(int8 "
                    "weights, activations as the W8A16 kernel holds them)", n, k)
        else:
            kernel = _pack_w8a8(scheme, packed)
    except RuntimeError as e:  # torch's kernel refused this shape: keep the reference, say so
        logger.warning(
            "ops[cpu]: %s kernel unavailable for [%d x %d] (%s); this layer runs the reference",
            scheme, n, k,
            str(e).splitlines()[0][:160])
        kernel = None
    if kernel is not None:
        packed["cpu"] = kernel
    return packed


def _pack_weight_only(scheme: str, packed: dict, n: int, k: int, block_kernels) -> dict | None:
    scale, zero = packed["weight_scale"].float().reshape(n, -1), packed.get("weight_zero")
    groups = scale.shape[1]
    if scheme != "w4a16":
        why = ("zero points" if zero is not None else "group scales"
               if groups != 1 else f"K = {k} not a multiple of {gguf_reference.BLOCK}" if k %
               gguf_reference.BLOCK else None)
        gguf_kernels = block_kernels() if why is None else None
        if why is None and gguf_kernels is None:
            why = "no GGUF kernels"
        if why is not None:
            logger.info(
                "ops[cpu]: int8 layer [%d x %d] with %s runs dequantize + matmul (the int8 kernel "
                "takes "
                "symmetric per-channel scales and K in blocks of 32)", n, k, why)
            return None
        blocks = gguf_reference.q8_0_blocks(packed["weight"].contiguous())
        return {
            "kind": "int8", "weight": gguf_kernels.pack(blocks,
                                                        Q8_0), "linear": gguf_kernels.linear,
            "linear_bf16": gguf_kernels.int8_linear_bf16 if gguf_kernels.bf16_panels else None,
            "scale": scale.reshape(n).contiguous()
        }
    group = k // groups
    if group not in INT4_GROUPS:
        logger.info(
            "ops[cpu]: int4 layer [%d x %d] with groups of %d runs dequantize + matmul (kernel "
            "groups: %s)",
            n, k, group, INT4_GROUPS)
        return None
    unsigned = (packed["weight"].to(torch.int32) + 8)
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned.contiguous(), 1)
    zeros = torch.zeros_like(scale) if zero is None else -zero.float().reshape(n, groups) * scale
    scale_zeros = torch.stack([scale.t(), zeros.t()], -1).contiguous()  # [K/g, N, 2]
    return {"kind": "int4", "weight": weight, "group": group,
            "scale_zeros": {dtype: scale_zeros.to(dtype) for dtype in KERNEL_DTYPES}}


def _pack_w8a8(scheme: str, packed: dict) -> dict:
    weight = packed["weight"]
    n = weight.shape[0]
    kernel = {"kind": scheme, "weight": torch.ops.onednn.qlinear_prepack(weight.contiguous(), None),
              "zeros": torch.zeros(n, dtype=torch.int64)}
    if scheme == "w8a8_dynamic":
        kernel["scale"] = packed["weight_scale"].float().reshape(n).contiguous()
    else:
        deq = packed["deq_scale"].float().reshape(n).contiguous()
        kernel["scale"] = deq
        # (acc + quant_bias) * deq, split
        kernel["offset"] = packed["quant_bias"].double() * deq.double()
    return kernel


def weight_only_linear(x: torch.Tensor, packed: dict, bias: torch.Tensor | None,
                       dense_rows: int = DENSE_ROWS):
    kernel = packed.get("cpu")
    if kernel is not None and kernel["kind"] == "int8_vnni" and x.numel():
        return int8_panels.linear(x, kernel, bias)
    if kernel is not None and kernel["kind"] == "int8" and x.numel():
        if (x.dtype == torch.bfloat16 and kernel["linear_bf16"] is not None
                and x.numel() >= BF16_PANEL_ROWS * x.shape[-1]):
            return kernel["linear_bf16"](x, kernel["weight"], kernel["scale"], bias)
        return kernel["linear"](x, kernel["weight"], Q8_0, bias, kernel["scale"])
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if kernel is None or kernel[
            "kind"] != "int4" or x.dtype not in KERNEL_DTYPES or rows > dense_rows or rows == 0:
        return quant_reference.weight_only_linear(x, packed, bias)
    x2 = x.reshape(rows, x.shape[-1]).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, kernel["weight"], kernel["group"],
                                                   kernel["scale_zeros"][x.dtype])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _qlinear(x_q: torch.Tensor, kernel: dict) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(x_q, 1.0, 0, kernel["weight"], kernel["scale"],
                                              kernel["zeros"], None, 1.0, 0, torch.float32, "none",
                                              [], "")


def w8a8_dynamic_linear(x: torch.Tensor, packed: dict, bias: torch.Tensor | None):
    kernel = packed.get("cpu")
    if kernel is None:
        return quant_reference.w8a8_dynamic_linear(x, packed, bias)
    if kernel["kind"] == "int8_vnni":
        return int8_panels.linear(x, kernel, bias) if x.numel() else \
            quant_reference.w8a8_dynamic_linear(x, packed, bias)
    if kernel["kind"] != "w8a8_dynamic":  # no VNNI / AMX: int8 weight, float activations
        return weight_only_linear(
            x, {
                "weight": packed["weight"], "weight_scale": packed["weight_scale"],
                "weight_zero": None, "cpu": kernel
            }, bias)
    shape = x.shape
    x_q, x_scale = quant_reference.quantize_per_token(x.reshape(-1, shape[-1]))
    y = _qlinear(x_q, kernel) * x_scale[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], -1)


def w8a8_static_linear(x: torch.Tensor, packed: dict, bias: torch.Tensor | None):
    kernel = packed.get("cpu")
    if kernel is None:
        return quant_reference.w8a8_static_linear(x, packed, bias)
    if kernel["kind"] != "w8a8_static":  # no VNNI / AMX: the dequantized weight-only form
        weight_scale = packed.get("weight_scale")
        if weight_scale is None:
            return quant_reference.w8a8_static_linear(x, packed, bias)
        return weight_only_linear(x, {"weight": packed["weight"], "weight_scale": weight_scale,
                                      "weight_zero": None, "cpu": kernel}, bias)
    shape = x.shape
    x_q = quant_reference.quantize_per_tensor(x.reshape(-1, shape[-1]), packed["input_scale"],
                                              packed["input_offset"])
    y = _qlinear(x_q, kernel) + kernel["offset"].float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], -1)


def check_kernel(scheme: str, packed: dict, op) -> None:
    """Run the kernel once on a few rows and compare with the reference: a wrong layout fails here,
    at load."""
    k = packed["weight"].shape[1]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    reference = {
        "w8a8_dynamic": quant_reference.w8a8_dynamic_linear,
        "w8a8_static": quant_reference.w8a8_static_linear
    }
    expected = reference.get(scheme, quant_reference.weight_only_linear)(x, packed, None)
    if packed["cpu"]["kind"] in ("int8", "int4") or scheme == "w8a16":
        expected = quant_reference.weight_only_linear(x, packed, None)
    got = op(x, packed, None)
    err = (got - expected).abs().max().item()
    bound = 1e-3 * max(1.0, expected.abs().max().item())
    if not err <= bound:
        raise RuntimeError(
            f"{scheme} CPU kernel differs from the reference by {err:.3g} (bound {bound:.3g})")
