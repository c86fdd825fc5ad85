"""Pooling requests: what a pooling engine runs (an embedder's last hidden state, a reranker's label logits) and how
one pooled row becomes a request's output (Matryoshka dimensions, normalization, the reranker's score)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlinfer.outputs import ClassificationOutput, EmbeddingOutput, PoolingOutput, ScoringOutput
from vlinfer.pooling_params import PoolingParams


@dataclass(frozen=True)
class PoolingSpec:
    """task "embed": the final layer's (normed) hidden state at the last prompt token, as the Qwen3-VL-Embedding code
    pools it. task "classify": the LM head's rows of label_token_ids at that token; the Qwen rerankers' score is
    sigmoid(logit[label 1] - logit[label 0]) (their "yes" minus their "no")."""
    task: str
    hidden_size: int
    label_token_ids: tuple[int, ...] = ()

    def check(self, params: PoolingParams, model_name: str) -> None:
        """A request this engine cannot answer is a ValueError naming why, before it is queued."""
        task = params.task
        if self.task == "embed" and task in ("classify",):
            raise ValueError(f"model {model_name!r} is an embedding model: it has no classifier for task {task!r}")
        if self.task == "classify" and task == "embed":
            raise ValueError(f"model {model_name!r} is a classification (reranker) model: it gives scores, not "
                             "embeddings")
        if params.dimensions is not None:
            if self.task != "embed":
                raise ValueError("PoolingParams.dimensions applies to embeddings only")
            if params.dimensions > self.hidden_size:
                raise ValueError(f"dimensions={params.dimensions} is larger than the model's embedding size "
                                 f"{self.hidden_size}")

    def output(self, params: PoolingParams, row: torch.Tensor):
        """The request's output object from its pooled row (float32 on the host)."""
        if self.task == "classify":
            score = torch.sigmoid(row[1] - row[0]).item()
            if params.task == "score":
                return ScoringOutput(score)
            return ClassificationOutput([score]) if params.task == "classify" else PoolingOutput([score])
        vector = row[:params.dimensions] if params.dimensions is not None else row
        if params.normalize is not False:
            vector = F.normalize(vector, p=2, dim=-1)
        values = vector.tolist()
        return EmbeddingOutput(values) if params.task in ("embed", "score") else PoolingOutput(values)
