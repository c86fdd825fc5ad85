"""Builders and constants of tests/layers/quantization/test_kv_cache_schemes.py that other test
modules use too (STATIC_INT8_TOLERANCE, c8_scales, kv_rows, write_variant): imported from here by
every one of them, that module included."""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from kv_cache_dtype_cases import path_logits
from text_parity_cases import PROMPTS
from vlinfer import LLM

# Static int8 scales are calibrated, not fitted to each row (README's correctness table,
# docs/kv-cache.md).
STATIC_INT8_TOLERANCE = 5e-2


def kv_rows(path: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every decoder layer's K and V rows [tokens, kv_heads, head_dim] over PROMPTS, as our float32
    engine stores them (after the norms and rotary): the calibration set."""
    llm = LLM(path, dtype="float32", kv_cache_bytes=8 << 20)
    layers = llm.engine.model_runner.cache_pool.layers
    rows = [([], []) for _ in layers]

    def capture(i):
        def hook(module, args):
            rows[i][0].append(args[1].clone())
            rows[i][1].append(args[2].clone())
        return hook
    hooks = [layer.register_forward_pre_hook(capture(i)) for i, layer in enumerate(layers)]
    path_logits(llm, PROMPTS)
    for hook in hooks:
        hook.remove()
    return [(torch.cat(k), torch.cat(v)) for k, v in rows]


def write_variant(src: str, dst: str, tensors: dict, quantization_config: dict | None = None,
                  description: dict | None = None) -> str:
    shutil.copytree(src, dst)
    state = load_file(os.path.join(dst, "model.safetensors"))
    save_file({**state, **tensors}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    if quantization_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = quantization_config
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    if description is not None:
        with open(os.path.join(dst, "quant_model_description.json"), "w") as f:
            json.dump(description, f)
    return dst


def c8_scales(rows) -> dict:
    """msModelSlim C8: per channel, asymmetric (the min-max rule of its W8A16 weights)."""
    tensors = {}
    for i, (k, v) in enumerate(rows):
        for side, x in (("k", k), ("v", v)):
            flat = x.flatten(1)
            low, high = flat.amin(0).clamp(max=0), flat.amax(0).clamp(min=0)
            scale = ((high - low) / 255).clamp(min=1e-8)
            tensors[f"model.layers.{i}.self_attn.{side}_proj.kv_cache_scale"] = scale
            tensors[f"model.layers.{i}.self_attn.{side}_proj.kv_cache_offset"] = -128 - torch.round(
                low / scale)
    return tensors
