"""Maps a checkpoint's `architectures` name to our model class."""
import importlib

_MODELS = {
    "LlamaForCausalLM": ("vlinfer.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("vlinfer.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("vlinfer.models.qwen3_vl",
                                        "Qwen3VLForConditionalGeneration"),
    "Qwen3_5ForCausalLM": ("vlinfer.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("vlinfer.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("vlinfer.models.qwen3_5_vl",
                                        "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("vlinfer.models.qwen3_5_vl",
                                           "Qwen3_5MoeForConditionalGeneration"),
    "Qwen3NextForCausalLM": ("vlinfer.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3MoeForCausalLM": ("vlinfer.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3VLMoeForConditionalGeneration": ("vlinfer.models.qwen3_vl_moe",
                                           "Qwen3VLMoeForConditionalGeneration"),
}

# Classification architectures (vLLM's names, set through hf_overrides for the Qwen rerankers): the
# generative model they are built on, whose LM head rows of `classifier_from_token` are the
# classifier.
_CLASSIFIERS = {
    "Qwen3VLForSequenceClassification": "Qwen3VLForConditionalGeneration",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "LlamaForSequenceClassification": "LlamaForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *_CLASSIFIERS])


def get_model_class(config):
    for arch in getattr(config, "architectures", None) or []:
        arch = _CLASSIFIERS.get(arch, arch)
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported model architecture {getattr(config, 'architectures', None)}; "
                     f"vlinfer supports {supported_architectures()}")


def pooling_task(config, runner: str, has_lm_head: bool) -> str | None:
    """What the engine runs: None (generation), "embed" (the last token's hidden state) or
    "classify" (the LM head's rows of config.classifier_from_token at the last token, vLLM's
    conversion of the Qwen rerankers). runner="auto" picks pooling for a classification architecture
    or a checkpoint with no LM head (an embedder saved without one), as vLLM's auto runner reads the
    architecture."""
    classifier = any(arch in _CLASSIFIERS for arch in getattr(config, "architectures", None) or [])
    if runner == "generate":
        if classifier:
            raise ValueError(
                f"{config.architectures} is a classification model: run it with runner='pooling'")
        return None
    if runner == "auto" and not classifier and has_lm_head:
        return None
    if classifier or getattr(config, "classifier_from_token", None):
        labels = getattr(config, "classifier_from_token", None)
        if not (isinstance(labels, (list, tuple)) and len(labels) == 2 and
                all(isinstance(t, str) for t in labels)):
            raise ValueError(
                f"a classification model needs classifier_from_token = two token strings (the Qwen "
                f"rerankers: ['no', 'yes'], through hf_overrides), got {labels!r}")
        if not getattr(config, "is_original_qwen3_reranker", False):
            raise ValueError(
                "classifier_from_token is supported for the Qwen rerankers "
                "(is_original_qwen3_reranker="
                "True: the score is sigmoid(logit of the second token - logit of the first))")
        return "classify"
    return "embed"
