"""Reads a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) into
per-module A / B tensors and its scaling, refusing what the engine cannot run by name."""
import json
import os
from dataclasses import dataclass

import torch

PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAAdapter:
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # checkpoint module name (e.g. "model.layers.0.self_attn.q_proj") -> (lora_A [r, in], lora_B
    # [out, r])
    modules: dict


def read_peft_adapter(path: str) -> LoRAAdapter:
    """The adapter at `path`; ValueError naming the file and the reason when it cannot be read or
    run."""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path) or not os.path.exists(config_file):
        raise ValueError(
            f"LoRA adapter {path!r}: no adapter_config.json there (a PEFT adapter folder is "
            "expected)"
        )
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"LoRA adapter {path!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(
            f"LoRA adapter {path!r}: peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
                   "alpha_pattern": {}}
    for key, off in unsupported.items():
        if config.get(key) not in (None, off):
            raise ValueError(f"LoRA adapter {path!r}: {key}={config[key]!r} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(
            f"LoRA adapter {path!r}: r={rank!r} / lora_alpha={alpha!r} are not a rank and a number")
    scaling = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(path)
    modules = {}
    for name, tensor in tensors.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                module = name[:-len(suffix)]
                module = module[len(PEFT_PREFIX):] if module.startswith(PEFT_PREFIX) else module
                modules.setdefault(module, {})[part] = tensor
                break
        else:
            raise ValueError(
                f"LoRA adapter {path!r}: tensor {name!r} is not a lora_A / lora_B weight")
    for module, pair in modules.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {path!r}: module {module!r} has {sorted(pair)} only")
        a, b = _as_linear(path, module, pair["lora_A"], pair["lora_B"])
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {path!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, not rank {rank}")
    if not modules:
        raise ValueError(f"LoRA adapter {path!r}: no LoRA weights in it")
    return LoRAAdapter(path, rank, scaling,
                       {m: _as_linear(path, m, p["lora_A"], p["lora_B"])
                        for m, p in modules.items()})


def _as_linear(path: str, module: str, a: torch.Tensor,
               b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A module's lora_A [r, in] and lora_B [out, r]. A conv's (PEFT's Conv3d adapter on the vision
    towers' patch embedding: lora_A a conv with the base's kernel and stride [r, C, *kernel], lora_B
    a 1 x ... x 1 conv [out, r, 1, ...]) is its flattened linear one: vlinfer holds a conv only as
    the matmul of a kernel == stride patch (C * kernel inputs, the element order of the base weight
    flattened on load), and targets() checks the flattened width against that layer."""
    if a.dim() == b.dim() > 2 and all(size == 1 for size in b.shape[2:]):
        return a.reshape(a.shape[0], -1), b.reshape(b.shape[0], b.shape[1])
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"LoRA adapter {path!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}: neither a linear layer's adapter nor a patch conv's (lora_B a "
            "1 x ... x 1 conv)")
    return a, b


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(file):
        raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors there")
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(
            f"LoRA adapter {path!r}: adapter_model.safetensors cannot be read ({e})") from None
