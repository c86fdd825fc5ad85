"""`ReferenceOps`: the op table of pure-torch definitions (this package's files, one per op family).
It is the table an engine holds when no device kernel applies, and the base class of every device
table (ops/cpu/, ops/cuda/, ops/npu/): a device overrides the ops it has kernels for, and the others
stay on these definitions."""
import torch

from vlinfer.ops.interface import Backend
from vlinfer.ops.reference import (activation, attention, bitmask, gguf, kv_cache,
                                   linear_attention, lora, moe, norm, quant, rotary)
# By name: the package re-exports the function `linear` under its module's name.
from vlinfer.ops.reference.linear import linear as dense_linear


class ReferenceOps(Backend):
    """The op table layers call through their engine's ModelContext. Subclasses override ops and may
    keep state (a loaded extension, per-step caches); the reference keeps none."""
    name = "reference"

    store_kvcache = staticmethod(kv_cache.store_kvcache)
    paged_attention = staticmethod(attention.paged_attention)
    # A KV cache in another dtype than the compute dtype (EngineConfig.kv_cache_dtype): written
    # quantized, read back dequantized.
    store_quantized_kvcache = staticmethod(kv_cache.store_quantized_kvcache)
    quantized_paged_attention = staticmethod(attention.quantized_paged_attention)

    def int8_kv_scales(self, shape: tuple, device) -> torch.Tensor:
        """Contiguous here; a table whose kernels read them in another memory order returns a view
        of it."""
        return torch.ones(*shape, dtype=torch.float32, device=device)

    apply_rotary = staticmethod(rotary.apply_rotary)
    rms_norm = staticmethod(norm.rms_norm)
    add_rms_norm = staticmethod(norm.add_rms_norm)
    silu_and_mul = staticmethod(activation.silu_and_mul)
    gelu_tanh = staticmethod(activation.gelu_tanh)
    varlen_attention = staticmethod(attention.varlen_attention)
    linear = staticmethod(dense_linear)
    # Hybrid models' linear-attention layers, over per-sequence state slots.
    causal_conv1d = staticmethod(linear_attention.causal_conv1d)
    gated_delta_rule = staticmethod(linear_attention.gated_delta_rule)
    gated_rms_norm = staticmethod(linear_attention.gated_rms_norm)
    fused_moe = staticmethod(moe.fused_moe)
    apply_token_bitmask = staticmethod(bitmask.apply_token_bitmask)
    # LoRA: each token's adapter update after the base layer, grouped by adapter slot
    # (layers/lora.py).
    add_lora = staticmethod(lora.add_lora)

    def pack_lora(self, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  sub_outputs: list[tuple[int, int]]):
        """None: add_lora reads the plain slots (the reference, CUDA, NPU)."""
        return None

    def repack_lora(self, packed, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Nothing packed, nothing to copy."""

    def pack_moe_weights(self, w13: torch.Tensor, w2: torch.Tensor):
        return moe.pack_moe_weights(w13, w2)

    w8a8_dynamic_linear = staticmethod(quant.w8a8_dynamic_linear)
    w8a8_static_linear = staticmethod(quant.w8a8_static_linear)
    weight_only_linear = staticmethod(quant.weight_only_linear)

    def pack_quantized_linear(self, scheme: str, tensors: dict) -> dict:
        """The canonical layout (quant.py). A table that changes the layout overrides the quantized
        ops too."""
        return quant.pack_quantized_linear(scheme, tensors)

    gguf_linear = staticmethod(gguf.gguf_linear)
    gguf_embedding = staticmethod(gguf.gguf_embedding)

    def pack_gguf_weight(self, weight: torch.Tensor, ggml_type: int) -> torch.Tensor | None:
        """None: the reference runs on the file's blocks, dequantizing them on every call."""
        return None

    def pack_linear_weight(self, weight: torch.Tensor,
                           large_rows: bool = False) -> torch.Tensor | None:
        """None: F.linear on the weight as loaded. Layers call it once after loading
        (build_model.pack_weights); ops never see the layers themselves."""
        return None

    def dense_decode_stack(self, layers: list[dict], num_heads: int, num_kv_heads: int,
                           head_dim: int, scale: float, eps: float, qk_eps: float,
                           kv_cache_dtype: torch.dtype | None = None):
        """None: the reference fuses nothing, the layers run module by module. `layers`: per layer
        its packed weights by name (LlamaDecoderLayer.decode_weights); models ask once after
        packing."""
        return None
