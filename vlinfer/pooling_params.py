"""PoolingParams: what a pooling request (embed, classify, score) asks of the pooled vector, shaped
like vLLM's."""
from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score")


@dataclass(frozen=True)
class PoolingParams:
    """dimensions: keep the vector's leading `dimensions` entries (Matryoshka), then normalize
    again. normalize: L2-normalize the embedding (None: True, the embedder's default; the Qwen code
    normalizes). truncate_prompt_tokens: keep the last k prompt tokens (-1: max_model_len), as
    SamplingParams does. task: set by LLM.embed / classify / score and the server; checked against
    the engine's runner."""
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None

    def __post_init__(self):
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or
                                            not isinstance(self.dimensions, int) or
                                            self.dimensions < 1):
            raise ValueError(
                f"PoolingParams.dimensions must be a positive int, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(
                f"PoolingParams.normalize must be True, False or None, got {self.normalize!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise ValueError(
                f"PoolingParams.truncate_prompt_tokens must be a positive int or -1, got {k!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(
                f"PoolingParams.task must be one of {POOLING_TASKS}, got {self.task!r}")
