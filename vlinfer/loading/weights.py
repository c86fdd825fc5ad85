"""Copies checkpoint tensors into a model's parameters, through fused-module mappings and each
parameter's own weight_loader (which takes the tensor-parallel shard)."""
from collections.abc import Iterator

import torch
from torch import nn


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]],
                 prefix_map: dict | None = None):
    """Copy checkpoint tensors (or lazy CheckpointSlices) into the model, splitting into fused
    parameters through the model's packed_modules_mapping and each parameter's weight_loader (which
    also takes the tensor-parallel shard, reading only that part of a lazy slice)."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded = set()
    for name, tensor in weights:
        for old, new in (prefix_map or {}).items():
            if name.startswith(old):
                name = new + name[len(old):]
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        for fragment, (fused, shard_id) in packed.items():
            if f".{fragment}." in name:
                target = name.replace(f".{fragment}.", f".{fused}.")
                if target not in params:  # a misspelt or damaged name around a fused fragment
                    raise _unmatched(name, model)
                param = params[target]
                _load_one(name, param.weight_loader, param, tensor, shard_id)
                loaded.add((target, shard_id))
                break
        else:
            if name not in params:
                raise _unmatched(name, model)
            param = params[name]
            _load_one(name, getattr(param, "weight_loader", _copy), param, tensor)
            loaded.add((name, None))
    loaded_names = {n for n, _ in loaded}
    # A parameter marked loaded_by_owner is filled by its model's own load_weights from tensors it
    # routes itself (MoE experts: per-expert or fused checkpoint tensors), which also checks it is
    # complete.
    missing = [
        n for n, p in params.items() if n not in loaded_names and
        not (tied and n == "lm_head.weight") and not getattr(p, "loaded_by_owner", False)
    ]
    if missing:
        raise ValueError(
            f"checkpoint is missing weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _unmatched(name: str, model: nn.Module) -> ValueError:
    return ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                      f"{type(model).__name__}")


def _load_one(name: str, loader, *args) -> None:
    """A weight that does not fit its parameter (a config that disagrees with its checkpoint) names
    itself."""
    try:
        loader(*args)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def _copy(param: nn.Parameter, tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(tensor.shape)}")
    param.data.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor.full())
