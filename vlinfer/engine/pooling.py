"""Pooling requests: what a pooling engine runs (an embedder's last hidden state, a reranker's label
logits) and how one pooled row becomes a request's output (Matryoshka dimensions, normalization, the
reranker's score)."""
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlinfer import loading
from vlinfer.config import EngineConfig
from vlinfer.engine.sequence import Sequence
from vlinfer.models import pooling_task
from vlinfer.outputs import (ClassificationOutput, EmbeddingOutput, PoolingOutput,
                             PoolingRequestOutput, ScoringOutput)
from vlinfer.pooling_params import PoolingParams

logger = logging.getLogger("vlinfer")


@dataclass(frozen=True)
class PoolingSpec:
    """task "embed": the final layer's (normed) hidden state at the last prompt token, as the
    Qwen3-VL-Embedding code pools it. task "classify": the LM head's rows of label_token_ids at that
    token; the Qwen rerankers' score is sigmoid(logit[label 1] - logit[label 0]) (their "yes" minus
    their "no")."""
    task: str
    hidden_size: int
    label_token_ids: tuple[int, ...] = ()

    def check(self, params: PoolingParams, model_name: str) -> None:
        """A request this engine cannot answer is a ValueError naming why, before it is queued."""
        task = params.task
        if self.task == "embed" and task == "classify":
            raise ValueError(
                f"model {model_name!r} is an embedding model: it has no classifier for task "
                f"{task!r}"
            )
        if self.task == "classify" and task == "embed":
            raise ValueError(
                f"model {model_name!r} is a classification (reranker) model: it gives scores, not "
                "embeddings")
        if params.dimensions is not None:
            if self.task != "embed":
                raise ValueError("PoolingParams.dimensions applies to embeddings only")
            if params.dimensions > self.hidden_size:
                raise ValueError(
                    f"dimensions={params.dimensions} is larger than the model's embedding size "
                    f"{self.hidden_size}")

    def output(self, params: PoolingParams, row: torch.Tensor):
        """The request's output object from its pooled row (float32 on the host)."""
        if self.task == "classify":
            score = torch.sigmoid(row[1] - row[0]).item()
            if params.task == "score":
                return ScoringOutput(score)
            return ClassificationOutput([score]) if params.task == "classify" else PoolingOutput(
                [score])
        vector = row[:params.dimensions] if params.dimensions is not None else row
        if params.normalize is not False:
            vector = F.normalize(vector, p=2, dim=-1)
        values = vector.tolist()
        return EmbeddingOutput(values) if params.task in ("embed",
                                                          "score") else PoolingOutput(values)

    def request_output(self, seq: Sequence, row: torch.Tensor) -> PoolingRequestOutput:
        """The finished request's output from its pooled row."""
        seq.metrics.finished_time = time.time()
        seq.finish_reason = "stop"
        return PoolingRequestOutput(seq.request_id, self.output(seq.pooling_params,
                                                                row), seq.prompt_token_ids, True,
                                    seq.num_cached_tokens, metrics=seq.metrics)


def resolve_pooling(config: EngineConfig, source, hf_config, tokenizer,
                    tensors: dict) -> tuple[PoolingSpec | None, bool]:
    """(what a pooling engine pools, None for a generating one; whether the checkpoint, whose
    tensors loading.checkpoint_tensor_index lists, has an LM head). The runner: the caller's, else
    the model source's (a retrieval alias), else "auto" (models/registry.py pooling_task)."""
    has_lm_head = loading.lm_head_table(tensors, hf_config) is not None
    runner = config.runner if config.runner != "auto" else (source.runner or "auto")
    task = pooling_task(hf_config, runner, has_lm_head)
    if task is None:
        return None, has_lm_head
    labels = ()
    if task == "classify":
        vocab = tokenizer.get_vocab()
        missing = [t for t in hf_config.classifier_from_token if t not in vocab]
        if missing:
            raise ValueError(
                f"classifier_from_token {missing} are not tokens of the model's vocabulary")
        labels = tuple(vocab[t] for t in hf_config.classifier_from_token)
    logger.info(
        "pooling runner: %s%s", task, f" from the LM head rows of {hf_config.classifier_from_token}"
        if labels else " (the last token's hidden state; no LM head computed)")
    return PoolingSpec(task, hf_config.get_text_config().hidden_size, labels), has_lm_head
