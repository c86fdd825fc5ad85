from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's entry in CompletionOutput.logprobs, vLLM's shape: its raw logprob (log_softmax of
    the model's logits before any processing: grammar masks, penalties, temperature), its rank in
    the vocabulary by that logprob (1 = the most likely) and its text decoded alone."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """vLLM's RequestOutput.metrics: wall-clock times (time.time()) of the request's life, seconds.
    """
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding (speculative_config): tokens proposed for this request and, of them,
    # those the model accepted; verification steps that carried proposals. All 0 without
    # speculation.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_drafts: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens; None when nothing was proposed."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens \
            if self.spec_num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens per verification step that carried proposals: the accepted ones plus the one the
        model adds."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts \
            if self.spec_num_drafts else None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else \
            self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" or "length" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    # per generated token: {token_id: Logprob}, the chosen included
    logprobs: list[dict[int, Logprob]] | None = None
    delta_text: str = ""  # from LLMEngine.step: what this step added to text
    delta_token_ids: list[int] = field(default_factory=list)
    # sum of the chosen tokens' raw logprobs; None unless logprobs asked
    cumulative_logprob: float | None = None
    # With a reasoning parser (LLM(..., reasoning_parser=)): the thinking, without its tags, while
    # `text` is the answer after it; None when the output did not think. delta_reasoning: what this
    # step added to it.
    reasoning: str | None = None
    delta_reasoning: str = ""

    @property
    def reasoning_content(self) -> str | None:
        """vLLM's older name of `reasoning`, kept as vLLM keeps it."""
        return self.reasoning


@dataclass
class ChatAnswer:
    """Pipeline.chat(..., detailed=True): one answer, its thinking apart (None when the model did
    not think or no reasoning parser runs), why it ended and its tokens."""
    text: str
    reasoning: str | None
    finish_reason: str | None
    token_ids: list[int]

    @property
    def reasoning_content(self) -> str | None:
        return self.reasoning


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # per image: effective (resized) size [h, w] and num_tokens
    images: list[dict] = field(default_factory=list)
    # per video: num_frames, frames_indices, fps (source), timestamps, size, grid_thw, num_tokens
    # (with the text)
    videos: list[dict] = field(default_factory=list)
    # why the request was rejected; it then has no tokens and finish_reason "error"
    error: str | None = None
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: per prompt token {token_id: Logprob}, the prompt's own token
    # included; the first entry is None (nothing precedes it), as vLLM
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @classmethod
    def rejected(cls, request_id: str, prompt, error: str) -> "RequestOutput":
        return cls(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                   prompt_token_ids=[],
                   outputs=[CompletionOutput(0, "", [],
                                             finish_reason="error")], finished=True, error=error)


class RequestError(ValueError):
    """Raised by LLM.generate when some requests were rejected. The others still ran: `outputs`
    holds every result in input order, the rejected ones with `.error` set."""

    def __init__(self, outputs: list[RequestOutput]):
        self.outputs = outputs
        errors = [f"request {i}: {o.error}" for i, o in enumerate(outputs) if o.error]
        super().__init__("; ".join(errors))


@dataclass
class PoolingOutput:
    """vLLM's PoolingOutput: the pooled data of one request (an embedding, or a classifier's
    probabilities)."""
    data: list[float]


@dataclass
class EmbeddingOutput:
    # L2-normalized unless PoolingParams(normalize=False); `dimensions` long when asked
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    # a reranker's [P(relevant)]: sigmoid of its "yes" logit minus its "no" logit
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float  # a reranker's relevance probability, or an embedder's cosine similarity


@dataclass
class PoolingRequestOutput:
    """One pooling request's result, vLLM's shape: `outputs` is an EmbeddingOutput (LLM.embed),
    ClassificationOutput (LLM.classify), ScoringOutput (LLM.score) or PoolingOutput (LLM.encode). A
    rejected request has `error` set and outputs None."""
    request_id: str
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput | PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics | None = None

    @classmethod
    def rejected(cls, request_id: str, error: str) -> "PoolingRequestOutput":
        return cls(request_id=request_id, outputs=None, prompt_token_ids=[], error=error)


# vLLM's names for the same object per task.
EmbeddingRequestOutput = ClassificationRequestOutput = ScoringRequestOutput = PoolingRequestOutput
