"""KV-cache schemes a checkpoint carries: the cache dtype it was calibrated for and its static
scales.

- compressed-tensors `quantization_config.kv_cache_scheme` (llm-compressor's output, what vLLM
  reads):
  - `type: float, num_bits: 8` -> an fp8 (e4m3) cache with one scale per layer for K and one for V,
    the
    `<layer>.self_attn.k_scale` / `.v_scale` tensors (older files: `k_proj.output_scale` /
    `v_proj.output_scale`);
  - `type: int, num_bits: 8` -> a static int8 cache, `strategy: tensor` (one scale per layer) or
    `attn_head` (one per
    KV head), the same tensor names.
  Symmetric, static schemes only: asymmetric, dynamic or other strategies are refused naming the
  field.
- msModelSlim `"kv_cache_type": "C8"` (quant_model_description.json): a static int8 cache with one
  scale and offset
  per KV channel, `<layer>.self_attn.k_proj.kv_cache_scale` / `.kv_cache_offset` and the same for
  `v_proj`
  ([kv_heads * head_dim]; no offset: 0).

Static int8 stores round(x / scale + offset) clamped to [-128, 127] and reads (stored - offset) *
scale (ops/reference/kv_cache.py: quantize_static). The scale tensors never reach load_weights:
`collect` takes them out of the checkpoint stream, `attach` checks them and gives each decoder
attention layer its rank's share."""
import json
import os
import re
from dataclasses import dataclass

import torch

from vlinfer.layers.quantization.detect import quantization_config
from vlinfer.layers.quantization.modelslim import DESCRIPTION_FILE
# <anything>.layers.<i>.self_attn.<what>: the decoder layer's index and the scale it names.
SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_scale|v_scale|k_proj\.output_scale|v_proj\.output_scale|"
    r"k_proj\.kv_cache_scale|v_proj\.kv_cache_scale|k_proj\.kv_cache_offset|"
    r"v_proj\.kv_cache_offset)$")
# What each checkpoint name holds: (K or V, scale or offset).
SCALE_ROLE = {
    "k_scale": ("k", "scale"), "v_scale": ("v", "scale"), "k_proj.output_scale": ("k", "scale"),
    "v_proj.output_scale": ("v", "scale"), "k_proj.kv_cache_scale": ("k", "scale"),
    "v_proj.kv_cache_scale": ("v", "scale"), "k_proj.kv_cache_offset": ("k", "offset"),
    "v_proj.kv_cache_offset": ("v", "offset")
}


@dataclass(frozen=True)
class KVCacheScheme:
    source: str  # for logs and errors: where the checkpoint declares it
    cache_dtype: torch.dtype  # torch.float8_e4m3fn or torch.int8
    granularity: str  # "tensor", "head" or "channel": how many scales each of K and V has per layer
    scale_names: tuple[str, ...]  # the SCALE_ROLE names that carry K's and V's scales (and offsets)

    def describe(self) -> str:
        kind = "fp8" if self.cache_dtype == torch.float8_e4m3fn else "static int8"
        return f"{self.source}: {kind} KV cache, scales per {self.granularity}"


@dataclass
class StaticKVScales:
    """One attention layer's checkpoint scales on this rank. fp8: 0-d k_scale / v_scale. Static
    int8: [kv_heads, head_dim] scales and offsets of this rank's KV heads (per-tensor and per-head
    scales broadcast)."""
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_offset: torch.Tensor | None = None
    v_offset: torch.Tensor | None = None


def detect_kv_cache_scheme(hf_config, folder: str | None) -> KVCacheScheme | None:
    """The checkpoint's KV scheme from its config files alone (before the model is built), or None.
    """
    if folder is not None and os.path.exists(os.path.join(folder, DESCRIPTION_FILE)):
        try:
            with open(os.path.join(folder, DESCRIPTION_FILE)) as f:
                kv_type = json.load(f).get("kv_cache_type")
        except (OSError, ValueError, AttributeError):
            return None  # the quantization detector names the unreadable file
        if kv_type == "C8":
            return KVCacheScheme(f"{DESCRIPTION_FILE} kv_cache_type=C8", torch.int8, "channel",
                                 ("k_proj.kv_cache_scale", "v_proj.kv_cache_scale",
                                  "k_proj.kv_cache_offset", "v_proj.kv_cache_offset"))
        return None
    config = quantization_config(hf_config)
    if not config or config.get(
            "quant_method") != "compressed-tensors" or not config.get("kv_cache_scheme"):
        return None
    return _compressed_tensors_scheme(config["kv_cache_scheme"])


def _compressed_tensors_scheme(raw: dict) -> KVCacheScheme:
    from compressed_tensors.quantization import QuantizationArgs
    where = "quantization_config.kv_cache_scheme"
    try:
        args = QuantizationArgs.model_validate(raw)
    except Exception as e:
        raise ValueError(f"{where} is not valid: {str(e).splitlines()[0]}") from None
    kind = str(getattr(args.type, "value", args.type))
    strategy = str(getattr(args.strategy, "value", args.strategy or "tensor"))
    if args.num_bits != 8 or kind not in ("float", "int"):
        raise ValueError(
            f"{where}: {kind} {args.num_bits}-bit KV caches are not supported (float 8-bit = fp8 "
            "e4m3, "
            "int 8-bit)")
    if not args.symmetric:
        raise ValueError(f"{where}: symmetric=false (asymmetric {kind}8 KV cache) is not supported")
    if args.dynamic not in (False, None):
        raise ValueError(
            f"{where}: dynamic={args.dynamic!r} is not supported; a KV scheme's scales come from "
            "the "
            "checkpoint (for scales computed at run time use kv_cache_dtype='int8')")
    allowed = ("tensor",) if kind == "float" else ("tensor", "attn_head")
    if strategy not in allowed:
        raise ValueError(
            f"{where}: strategy={strategy!r} is not supported for a {kind}8 KV cache (supported: "
            f"{', '.join(allowed)})")
    return KVCacheScheme(where, torch.float8_e4m3fn if kind == "float" else torch.int8,
                         "head" if strategy == "attn_head" else "tensor",
                         ("k_scale", "v_scale", "k_proj.output_scale", "v_proj.output_scale"))


def collect(weights, found: dict):
    """Pass the checkpoint stream on without its KV scale tensors, which go into found[(layer index,
    name)]."""
    for name, tensor in weights:
        match = SCALE_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        value = tensor if isinstance(tensor, torch.Tensor) else tensor.full()
        found[(int(match.group(1)), match.group(2))] = (name, value.float())


def attach(scheme: KVCacheScheme, found: dict, attention_modules: list, use: bool) -> None:
    """Check the collected scales against the scheme and give each decoder attention module
    (`qkv_proj` and `attn` children, in layer order) its rank's StaticKVScales as
    `attn.static_kv_scales`; with use=False (the engine runs another cache dtype) they are checked,
    then dropped."""
    stray = sorted(name for (_, key), (name, _) in found.items() if key not in scheme.scale_names)
    if stray:
        raise ValueError(
            f"checkpoint tensor {stray[0]!r} is not a scale of the checkpoint's KV scheme "
            f"({scheme.describe()})")
    for index, module in enumerate(attention_modules):
        attn, qkv = module.attn, module.qkv_proj
        scales = {}
        for side in ("k", "v"):
            for role in ("scale", "offset"):
                names = [n for n in scheme.scale_names if SCALE_ROLE[n] == (side, role)]
                hits = [found[(index, n)] for n in names if (index, n) in found]
                if not hits:
                    if role == "scale":
                        raise ValueError(
                            f"decoder layer {index}: the checkpoint's KV scheme "
                            f"({scheme.describe()}) "
                            f"needs its {side.upper()} scale, tensor '...layers.{index}.self_attn."
                            f"{names[0]}', which is missing")
                    continue
                name, value = hits[0]
                scales[f"{side}_{role}"] = _rank_share(scheme, name, value, qkv, attn.head_dim)
        attn.static_kv_scales = StaticKVScales(**scales) if use else None
    extra = sorted(index for index, _ in found if index >= len(attention_modules))
    if extra:
        raise ValueError(
            f"checkpoint has KV scales for decoder layer {extra[0]}, but the model has "
            f"{len(attention_modules)} layers")


def _rank_share(scheme: KVCacheScheme, name: str, value: torch.Tensor, qkv,
                head_dim: int) -> torch.Tensor:
    """A scale tensor checked against its scheme's shape and cut to this rank's KV heads: 0-d for
    fp8, [kv_heads, head_dim] for static int8."""
    total_heads = qkv.total_sizes["k"] // head_dim
    expected = {"tensor": 1, "head": total_heads,
                "channel": total_heads * head_dim}[scheme.granularity]
    if value.numel() != expected or (scheme.granularity != "tensor" and value.dim() > 2):
        raise ValueError(
            f"checkpoint tensor {name!r}: shape {tuple(value.shape)}, but a scale per "
            f"{scheme.granularity} of this model's {total_heads} KV heads x {head_dim} needs "
            f"{expected} "
            "values")
    if not torch.isfinite(value).all() or ("scale" in name and bool((value <= 0).any())):
        raise ValueError(f"checkpoint tensor {name!r}: scales must be finite and positive")
    if scheme.cache_dtype != torch.int8:
        return value.reshape(())
    per_head = value.reshape(-1, head_dim) if scheme.granularity == "channel" else value.reshape(
        -1, 1)
    per_head = per_head.expand(total_heads, head_dim)
    return per_head[qkv.kv_head_start:qkv.kv_head_start + qkv.num_kv_heads].contiguous()
