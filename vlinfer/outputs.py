from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" or "length" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}, the chosen included
    delta_text: str = ""  # from LLMEngine.step: what this step added to text
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    images: list[dict] = field(default_factory=list)  # per image: effective (resized) size [h, w] and num_tokens
    metrics: dict = field(default_factory=dict)
