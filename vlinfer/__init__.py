"""vlinfer: a small inference engine for vision-language and language models."""
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.llm import LLM
from vlinfer.model_loader import ModelNotFoundError
from vlinfer.pipeline import Pipeline
from vlinfer.outputs import CompletionOutput, RequestError, RequestOutput
from vlinfer.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "Pipeline", "CompletionOutput", "LLMEngine", "ModelNotFoundError", "RequestError", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
