"""vlinfer: a small inference engine for vision-language and language models.

The public face: LLM and Pipeline, SamplingParams, PoolingParams and StructuredOutputsParams, the
outputs, the engine and its errors. Each is imported on first use, so `import vlinfer.multimodal`
(or any other room) loads that room alone."""
import importlib

__version__ = "0.1.0"
_PUBLIC = {
    "LLM": "vlinfer.llm",
    "Pipeline": "vlinfer.pipeline",
    "SamplingParams": "vlinfer.sampling_params",
    "PoolingParams": "vlinfer.pooling_params",
    "LoRARequest": "vlinfer.lora_request",
    "PoolingRequestOutput": "vlinfer.outputs",
    "EmbeddingRequestOutput": "vlinfer.outputs",
    "ClassificationRequestOutput": "vlinfer.outputs",
    "ScoringRequestOutput": "vlinfer.outputs",
    "StructuredOutputsParams": "vlinfer.sampling_params",
    "CompletionOutput": "vlinfer.outputs",
    "Logprob": "vlinfer.outputs",
    "RequestMetrics": "vlinfer.outputs",
    "RequestError": "vlinfer.outputs",
    "RequestOutput": "vlinfer.outputs",
    "EngineConfig": "vlinfer.config",
    "LLMEngine": "vlinfer.engine",
    "ModelNotFoundError": "vlinfer.loading",
    "CheckpointError": "vlinfer.loading",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'vlinfer' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_PUBLIC])
