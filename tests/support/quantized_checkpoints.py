"""Writers of tiny quantized checkpoints for tests/layers/quantization/test_quantized.py, each
following its format's own rules: the compressed-tensors package computes the scales
(calculate_qparams), quantizes (quantize), packs (pack_to_int32) and writes the config
(QuantizationConfig); FP8 block checkpoints follow Qwen's layout (weight float8_e4m3fn +
weight_scale_inv per 128 x 128 block). Each writer also returns the dequantized weights, which the
transformers reference runs."""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   # Qwen3.5's Gated DeltaNet projections
                   "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def _linear_names(state: dict, include_vision: bool = False) -> list[str]:
    names = []
    for name in state:
        if not name.endswith(".weight") or state[name].dim() != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in LINEAR_SUFFIXES and (include_vision or
                                                             ".visual." not in name):
            names.append(module)
    return names


def _copy_folder(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)


def _write(dst: str, tensors: dict, quantization_config: dict) -> None:
    save_file({k: v.contiguous()
               for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def scheme_args(scheme: str, group_size: int):
    """compressed-tensors QuantizationScheme for one of the schemes the tests write."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    weights = {
        "w4a16": dict(num_bits=4, strategy="group", group_size=group_size,
                      symmetric=True), "w4a16_asym": dict(num_bits=4, strategy="group",
                                                          group_size=group_size, symmetric=False),
        "w8a16": dict(num_bits=8, strategy="channel",
                      symmetric=True), "w8a16_group": dict(num_bits=8, strategy="group",
                                                           group_size=group_size, symmetric=True),
        "w8a8_dynamic": dict(num_bits=8, strategy="channel",
                             symmetric=True), "w8a8_static": dict(num_bits=8, strategy="channel",
                                                                  symmetric=True)
    }[scheme]
    acts = {
        "w8a8_dynamic": dict(num_bits=8, strategy="token", symmetric=True, dynamic=True),
        "w8a8_static": dict(num_bits=8, strategy="tensor", symmetric=False, dynamic=False)
    }.get(scheme)
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                              input_activations=None if acts is None else QuantizationArgs(**acts))


def write_compressed_tensors(src: str, dst: str, scheme: str, group_size: int = 128, ignore=(),
                             input_scales: dict | None = None):
    """A compressed-tensors copy of the dense checkpoint in src. Returns (dequantized weights by
    tensor name, the scheme). input_scales: {module: (scale, zero_point)} for static activations
    (else calibrated from a fixed value)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    _copy_folder(src, dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    qscheme = scheme_args(scheme, group_size)
    args = qscheme.weights
    packed_format = qscheme.input_activations is None
    out, dequantized = dict(state), {}
    for module in _linear_names(state):
        if module in ignore or module.rsplit(".", 1)[-1] in ignore:
            continue
        w = state[f"{module}.weight"].float()
        n, k = w.shape
        if args.strategy == "group":
            grouped = w.reshape(n, k // args.group_size, args.group_size)
            scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        else:
            scale, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
        q = quantize(w, scale, zp, args, dtype=torch.int8)
        dequantized[f"{module}.weight"] = dequantize(q, scale, zp, args, dtype=torch.float32)
        del out[f"{module}.weight"]
        out[f"{module}.weight_scale"] = scale.float()
        if packed_format:
            out[f"{module}.weight_packed"] = pack_to_int32(q, args.num_bits)
            out[f"{module}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not args.symmetric:
                out[f"{module}.weight_zero_point"] = pack_to_int32(zp.to(torch.int8), args.num_bits,
                                                                   packed_dim=0)
        else:
            out[f"{module}.weight"] = q
        if scheme == "w8a8_static":
            s, z = (input_scales or {}).get(module, (0.02, 3))
            out[f"{module}.input_scale"] = torch.tensor([s], dtype=torch.float32)
            out[f"{module}.input_zero_point"] = torch.tensor([z], dtype=torch.int8)
    config = QuantizationConfig(config_groups={"group_0": qscheme},
                                quant_method="compressed-tensors",
                                format="pack-quantized" if packed_format else "int-quantized",
                                ignore=["lm_head", *ignore], quantization_status="compressed")
    _write(dst, out, config.model_dump(mode="json"))
    return dequantized, out


def write_fp8_block(src: str, dst: str, block: int = 128):
    """Qwen-style FP8: weight float8_e4m3fn, weight_scale_inv [ceil(N/b), ceil(K/b)] float32, W = W8
    * s_inv."""
    _copy_folder(src, dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    out, dequantized = dict(state), {}
    for module in _linear_names(state):
        w = state[f"{module}.weight"].float()
        n, k = w.shape
        nb, kb = -(-n // block), -(-k // block)
        padded = torch.zeros(nb * block, kb * block)
        padded[:n, :k] = w
        blocks = padded.reshape(nb, block, kb, block)
        scale = blocks.abs().amax((1, 3)) / 448.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
        w8 = (w / full).to(torch.float8_e4m3fn)
        out[f"{module}.weight"] = w8
        out[f"{module}.weight_scale_inv"] = scale
        dequantized[f"{module}.weight"] = w8.float() * full
    _write(dst, out, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [block, block]})
    return dequantized, out


# What Qwen's FP8 releases of Qwen3.5 keep dense, per decoder layer (their config's
# modules_to_not_convert lists each by its full name): the norms, the Gated DeltaNet's conv1d,
# A_log, dt_bias, gated norm and its small b / a projections, the router and the shared expert's
# gate; then lm_head and the embedding.
QWEN3_5_FP8_DENSE = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                     "self_attn.k_norm", "linear_attn.A_log", "linear_attn.conv1d",
                     "linear_attn.dt_bias", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                     "linear_attn.norm", "mlp.gate", "mlp.shared_expert_gate")


def write_qwen3_5_fp8(src: str, dst: str, block: int, transpose_scales: bool = False):
    """Qwen's FP8 release of a Qwen3.5 (or Qwen3.5-MoE) checkpoint, from the format's definition:
    each linear weight not in QWEN3_5_FP8_DENSE cut into block x block tiles (the last ones
    partial), s = max |tile| / 448 per tile rounded to bf16 (the releases' scale dtype), the
    weight float8_e4m3fn(W / s) (round to nearest, the cast), `weight_scale_inv` = s as
    [ceil(N / b), ceil(K / b)] (W = W8 * s: the name is the releases'); routed experts one tensor
    set per expert. quantization_config lists every dense module by name. Returns the dequantized
    weights by tensor name. transpose_scales (a planted mistake): square scale grids written
    [K blocks, N blocks]."""
    _copy_folder(src, dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    layers = sorted({int(n.split(".")[2]) for n in state if n.startswith("model.layers.")})
    dense = [f"model.layers.{i}.{leaf}" for i in layers for leaf in QWEN3_5_FP8_DENSE]
    out, dequantized = dict(state), {}
    for module in _linear_names(state):
        if any(module == d for d in dense):
            continue
        w = state[f"{module}.weight"].float()
        n, k = w.shape
        nb, kb = -(-n // block), -(-k // block)
        padded = torch.zeros(nb * block, kb * block)
        padded[:n, :k] = w
        tiles = padded.reshape(nb, block, kb, block)
        scale = (tiles.abs().amax((1, 3)) / 448.0).to(torch.bfloat16)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        full = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
        w8 = (w / full).to(torch.float8_e4m3fn)
        out[f"{module}.weight"] = w8
        out[f"{module}.weight_scale_inv"] = scale.T.contiguous() if (
            transpose_scales and nb == kb) else scale
        dequantized[f"{module}.weight"] = w8.float() * full
    _write(dst, out, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [block, block],
                      "modules_to_not_convert": ["lm_head", "model.embed_tokens", "model.norm",
                                                 *dense]})
    return dequantized
