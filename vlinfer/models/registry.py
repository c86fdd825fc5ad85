"""Maps a checkpoint's `architectures` name to our model class."""
import importlib

_MODELS = {
    "LlamaForCausalLM": ("vlinfer.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("vlinfer.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("vlinfer.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3MoeForCausalLM": ("vlinfer.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3VLMoeForConditionalGeneration": ("vlinfer.models.qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config):
    for arch in getattr(config, "architectures", None) or []:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported model architecture {getattr(config, 'architectures', None)}; "
                     f"vlinfer supports {supported_architectures()}")
