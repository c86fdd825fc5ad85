"""Quantized linears on torch_npu, the calls vllm-ascend makes (the shared quantization note,
quantization.md §1b, §3), behind the definitions in ops/reference/quant.py. NpuOps' quantized-op
methods are thin wrappers over these functions.

- W8A8 dynamic: npu_dynamic_quant (per-token int8 + fp32 scales), then npu_quant_matmul with the
  per-channel
  weight scale and pertoken_scale: y = x_q @ w * weight_scale * x_scale (+ bias, added by the op
  after scaling).
- W8A8 static: npu_quantize (x / input_scale + input_offset, div_mode=True), then npu_quant_matmul
  with deq_scale
  and the int32 quant_bias: y = (x_q @ w + quant_bias) * deq_scale. vllm-ascend passes the
  reciprocal scale with
  div_mode=False; dividing is the checkpoint's own formula, so the codes equal the reference's
  exactly.
- W8A16 / W4A16: npu_weight_quant_batchmatmul, y = x @ ((w + antiquant_offset) * antiquant_scale):
  the op adds the
  offset, so it gets minus the zero point (msModelSlim's description file: "the NPU op computes
  (weight + offset) *
  scale; the framework negates the offset at load"). int4 values are held one per int8 byte:
  correct, but not the
  packed int4 layout (npu_convert_weight_to_int4pack is not wired yet).
- Weights are transposed to [K, N] once at load (pack), as the ops' docs recommend; not cast to
  FRACTAL_NZ.
- What the ops cannot take runs the reference, logged once per engine: float32 activations
  (fp16/bf16 only), a
  static W8A8 layer with float16 activations (its fp32 deq_scale needs bfloat16 output; float16
  needs an int64
  scale from npu_trans_quant_param, not wired), per-group weight-only scales whose group is not a
  multiple of 32 in
  [32, K-1], and dims above 65535.
"""
import logging

import torch

from vlinfer.ops.reference import quant as quant_reference

logger = logging.getLogger("vlinfer")

HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_DIM = 65535  # npu_quant_matmul / npu_weight_quant_batchmatmul: K, N <= 65535


def pack(scheme: str, tensors: dict) -> dict:
    """The canonical tensors (quant_reference) laid out for the NPU ops: weight [K, N], scales
    flattened."""
    quant_reference.check_quantized_tensors(scheme, tensors)
    weight = tensors["weight"]
    n, k = weight.shape
    packed = {"weight": weight.t().contiguous(), "npu": k <= MAX_DIM and n <= MAX_DIM}
    if scheme == "w8a8_dynamic":
        packed["weight_scale"] = tensors["weight_scale"].float().reshape(n)
    elif scheme == "w8a8_static":
        offset = tensors["input_offset"].float().reshape(1)
        if not torch.equal(offset, offset.round()) or not -128 <= offset.item() <= 127:
            raise ValueError(f"w8a8_static: input_offset {offset.item()} is not an int8 value")
        packed.update(input_scale=tensors["input_scale"].float().reshape(1),
                      input_offset=offset.to(torch.int8),
                      quant_bias=tensors["quant_bias"].to(torch.int32).reshape(n),
                      deq_scale=tensors["deq_scale"].float().reshape(n))
    else:
        scale = tensors["weight_scale"].reshape(n, -1)
        groups = scale.shape[1]
        zero = tensors.get("weight_zero")
        # (ceil(K/g), N) per group, (N,) per channel; the offset is minus the zero point (see
        # above).
        packed["antiquant_scale"] = scale.t().contiguous() if groups > 1 else scale.reshape(
            n).contiguous()
        packed["antiquant_offset"] = None if zero is None else \
            (-zero.reshape(n, -1).float()).to(scale.dtype).t().contiguous().reshape(
                packed["antiquant_scale"].shape)
        group = k // groups if groups > 1 else 0
        packed["group_size"] = group
        if group and not (group % 32 == 0 and 32 <= group <= k - 1):
            packed["npu"] = False
        packed["cast"] = {}  # scales in the activation dtype, made at first use per dtype
    packed["scheme"] = scheme
    return packed


def canonical(packed: dict) -> dict:
    """The reference's view of NPU-packed tensors (no copies), for the calls the NPU ops cannot
    take."""
    scheme = packed["scheme"]
    weight = packed["weight"].t()
    n = weight.shape[0]
    if scheme == "w8a8_dynamic":
        return {"weight": weight, "weight_scale": packed["weight_scale"]}
    if scheme == "w8a8_static":
        return {
            "weight": weight, **{
                key: packed[key]
                for key in ("input_scale", "input_offset", "quant_bias", "deq_scale")
            }
        }
    scale = packed["antiquant_scale"]
    scale = scale.t() if scale.dim() == 2 else scale.reshape(n, 1)
    offset = packed["antiquant_offset"]
    zero = None if offset is None else -(
        offset.t() if offset.dim() == 2 else offset.reshape(n, 1)).float()
    return {"weight": weight, "weight_scale": scale, "weight_zero": zero}


def w8a8_dynamic_linear(ops, x, packed, bias):
    if _fallback(ops, "w8a8_dynamic_linear", x, packed, HALF_DTYPES):
        return quant_reference.w8a8_dynamic_linear(x, canonical(packed), bias)
    torch_npu = ops._torch_npu
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x_q, x_scale = torch_npu.npu_dynamic_quant(x2, dst_type=torch.int8)
    y = torch_npu.npu_quant_matmul(x_q, packed["weight"], packed["weight_scale"],
                                   pertoken_scale=x_scale,
                                   bias=None if bias is None else _float_bias(bias, x.dtype),
                                   output_dtype=x.dtype)
    return y.reshape(*shape[:-1], -1)


def w8a8_static_linear(ops, x, packed, bias):
    if _fallback(ops, "w8a8_static_linear", x, packed, (torch.bfloat16,)):
        return quant_reference.w8a8_static_linear(x, canonical(packed), bias)
    torch_npu = ops._torch_npu
    shape = x.shape
    x_q = torch_npu.npu_quantize(x.reshape(-1, shape[-1]), packed["input_scale"],
                                 packed["input_offset"], torch.qint8, -1, True)
    y = torch_npu.npu_quant_matmul(x_q, packed["weight"], packed["deq_scale"],
                                   bias=packed["quant_bias"], output_dtype=x.dtype)
    # one bias per call: quant_bias takes the slot; a float bias is added after
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*shape[:-1], -1)


def weight_only_linear(ops, x, packed, bias):
    if _fallback(ops, f"weight_only_linear ({packed['scheme']})", x, packed, HALF_DTYPES):
        return quant_reference.weight_only_linear(x, canonical(packed), bias)
    cast = packed["cast"]
    if x.dtype not in cast:  # antiquant scale and offset must have x's dtype
        offset = packed["antiquant_offset"]
        cast[x.dtype] = (packed["antiquant_scale"].to(x.dtype),
                         None if offset is None else offset.to(x.dtype))
    scale, offset = cast[x.dtype]
    shape = x.shape
    bias = None if bias is None else bias.to(torch.float32 if x.dtype ==
                                             torch.bfloat16 else x.dtype)
    y = ops._torch_npu.npu_weight_quant_batchmatmul(x.reshape(-1, shape[-1]), packed["weight"],
                                                    scale, antiquant_offset=offset, bias=bias,
                                                    antiquant_group_size=packed["group_size"])
    return y.reshape(*shape[:-1], -1)


def _float_bias(bias, dtype):
    # npu_quant_matmul's float bias after scaling: bf16 with bf16 output, fp16 with fp16 (OPD:4953).
    return bias.to(dtype)


def _fallback(ops, op: str, x, packed: dict, dtypes) -> bool:
    """Whether this call runs the reference; the reason is logged once per engine and op."""
    if x.dtype not in dtypes:
        why = (f"activations are {x.dtype}; "
               f"the torch_npu op takes {', '.join(str(d) for d in dtypes)} here")
    elif not packed["npu"]:
        why = (
            "the layer's shape or group size is outside the torch_npu op's limits (K, N <= "
            f"{MAX_DIM}; "
            f"per-group scales: a group that is a multiple of 32 in [32, K-1])")
    else:
        return False
    if (op, why) not in ops._warned:
        ops._warned.add((op, why))
        logger.warning("ops[npu]: %s runs the pure-torch reference: %s", op, why)
    return True
