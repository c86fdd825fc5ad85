"""Tiny msModelSlim checkpoints for tests, written by the format's documented rules (msModelSlim's
"quantization weight format" page: quant_model_weight*.safetensors + quant_model_description.json
mapping every tensor to FLOAT / W8A8 / W8A8_DYNAMIC / W8A16), and the transformers reference that
runs the same dequantized weights with the same activation quantization.

Quantization, per layer type (weights per output channel; W8A16 per group of 32 input features,
asymmetric):
- W8A16: scale = (max - min) / 255, offset = -128 - round(min / scale), weight = clamp(round(W /
  scale) + offset);
  dequantized (weight - offset) * scale.
- W8A8_DYNAMIC: symmetric, scale = max|W| / 127, weight_offset 0.
- W8A8 (static): symmetric weights as above; input_scale / input_offset from min / max calibration
  of the layer's
  input over a calibration prompt (asymmetric, as msModelSlim's Qwen3-VL recipe), deq_scale =
  input_scale *
  weight_scale, quant_bias = round(bias / deq_scale) - input_offset * sum_k weight[n, k]; the float
  bias is not
  written (it is in quant_bias).
The reference: transformers on the dense checkpoint with each quantized linear's weight replaced by
its
dequantized one; W8A8 layers first quantize their input with vlinfer/ops/reference/quant.py's
per-token / per-tensor quantizers and dequantize it ((codes - offset) * scale), and a static layer
adds the bias quant_bias stands for, (quant_bias + input_offset * sum_k weight) * deq_scale."""
import json
import os
import shutil

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


GROUP = 32


def _w8a16(w):
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((high - low) / 255).clamp(min=1e-8)
    offset = -128 - torch.round(low / scale)
    q = torch.clamp(torch.round(g / scale[..., None]) + offset[..., None], -128, 127)
    deq = ((q - offset[..., None]) * scale[..., None]).reshape(n, k)
    return q.reshape(n, k).to(torch.int8), scale, offset, deq


def _symmetric(w):
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-8)
    q = torch.clamp(torch.round(w / scale), -128, 127)
    return q.to(torch.int8), scale, q * scale


def calibrate(model, run) -> dict:
    """min / max of every nn.Linear's input while `run(model)` runs: {module name: (min, max)}."""
    ranges, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(mod, args, name=name):
                x = args[0].detach().float()
                low, high = ranges.get(name, (0.0, 0.0))
                ranges[name] = (min(low, x.min().item()), max(high, x.max().item()))
            hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in hooks:
            h.remove()
    return ranges


def write_modelslim(dense_folder: str, out_folder: str, types: dict, ranges: dict) -> dict:
    """Write the msModelSlim checkpoint of dense_folder with `types` {module name: W8A8 |
    W8A8_DYNAMIC | W8A16} (others FLOAT). Returns what the reference needs: {module name: (kind,
    dequantized weight, extra)}."""
    os.makedirs(out_folder, exist_ok=True)
    for name in os.listdir(dense_folder):
        if not name.endswith(".safetensors") and not name.endswith(".index.json"):
            src = os.path.join(dense_folder, name)
            if os.path.isfile(src):
                shutil.copy(src, out_folder)
    state = {}
    for name in sorted(os.listdir(dense_folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(dense_folder, name)))
    out, description, reference = {}, {"model_quant_type": "W8A8", "version": "1.0.0"}, {}
    for key, tensor in state.items():
        prefix = key[:-len(".weight")] if key.endswith(".weight") else None
        kind = types.get(prefix)
        if kind is None:
            bias_of = key[:-len(".bias")] if key.endswith(".bias") else None
            if types.get(bias_of) == "W8A8":
                continue  # folded into quant_bias
            out[key], description[key] = tensor, "FLOAT"
            continue
        w = tensor.float()
        bias = state.get(f"{prefix}.bias")
        if kind == "W8A16":
            q, scale, offset, deq = _w8a16(w)
            layer = {
                "weight": q, "weight_scale": scale.to(tensor.dtype),
                "weight_offset": offset.to(tensor.dtype)
            }
            reference[prefix] = ("W8A16", deq, None)
        else:
            q, scale, deq = _symmetric(w)
            layer = {"weight": q, "weight_scale": scale.to(tensor.dtype),
                     "weight_offset": torch.zeros_like(scale).to(tensor.dtype)}
            if kind == "W8A8_DYNAMIC":
                reference[prefix] = ("W8A8_DYNAMIC", deq, None)
            else:
                low, high = ranges[prefix]
                low, high = min(low, 0.0), max(high, 0.0)
                input_scale = torch.tensor([max(high - low, 1e-6) / 255])
                input_offset = torch.tensor([float(-128 - round(low / input_scale.item()))])
                deq_scale = (input_scale * scale.reshape(-1)).float()
                folded = torch.zeros(w.shape[0]) if bias is None else torch.round(bias.float() /
                                                                                  deq_scale)
                quant_bias = (folded - input_offset * q.float().sum(1)).to(torch.int32)
                layer.update(input_scale=input_scale.to(tensor.dtype),
                             input_offset=input_offset.to(tensor.dtype), deq_scale=deq_scale,
                             quant_bias=quant_bias)
                effective_bias = (quant_bias.double() +
                                  input_offset.double() * q.double().sum(1)) * deq_scale.double()
                reference[prefix] = ("W8A8", deq, (input_scale, input_offset,
                                                   effective_bias.float()))
        for suffix, value in layer.items():
            out[f"{prefix}.{suffix}"] = value.contiguous()
            description[f"{prefix}.{suffix}"] = kind
    save_file(out, os.path.join(out_folder, "quant_model_weight_w8a8.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_folder, "quant_model_description.json"), "w") as f:
        json.dump(description, f, indent=2)
    return reference


# The activation quantizers written here from the format's definition (msModelSlim's W8A8 layers
# as torch_npu runs them), not imported from vlinfer (ops/reference/quant.py is the code under
# test): x rounded half to even and saturated to int8, then back to float.
def dynamic_per_token(rows: torch.Tensor) -> torch.Tensor:
    """W8A8_DYNAMIC (npu_dynamic_quant): per token, scale = max |x| / 127, symmetric."""
    scale = rows.abs().amax(-1, keepdim=True) / 127
    return torch.round(rows / torch.where(scale > 0, scale, 1.0)).clamp(-128, 127) * scale


def static_per_tensor(rows: torch.Tensor, input_scale: torch.Tensor,
                      input_offset: torch.Tensor) -> torch.Tensor:
    """W8A8 static (npu_quantize with the checkpoint's input_scale / input_offset, one value each):
    q = round(x / input_scale + input_offset) in int8, read back as (q - offset) * scale."""
    scale, offset = input_scale.float().reshape(-1)[0], input_offset.float().reshape(-1)[0]
    return (torch.round(rows / scale + offset).clamp(-128, 127) - offset) * scale


def apply_reference(model, reference: dict) -> None:
    """Make a transformers model (the dense checkpoint's) run the msModelSlim layers as vlinfer
    defines them."""
    modules = dict(model.named_modules())
    for prefix, (kind, deq, extra) in reference.items():
        module = modules[prefix]
        with torch.no_grad():
            module.weight.copy_(deq)
        if kind == "W8A16":
            continue

        def forward(x, module=module, kind=kind, extra=extra):
            rows = x.reshape(-1, x.shape[-1]).float()
            if kind == "W8A8_DYNAMIC":
                x_dq = dynamic_per_token(rows)
                bias = module.bias
            else:
                input_scale, input_offset, bias = extra
                x_dq = static_per_tensor(rows, input_scale, input_offset)
            y = F.linear(x_dq, module.weight.float(), None if bias is None else bias.float())
            return y.to(x.dtype).reshape(*x.shape[:-1], -1)
        module.forward = forward
