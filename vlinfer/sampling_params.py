from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling options, named and defaulted as in vLLM. temperature 0 means greedy."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or \
                    value in (float("inf"), float("-inf")):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
        for name in ("top_k", "max_tokens", "min_tokens"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be an int, got {getattr(self, name)!r}")

        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        need(isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature", "must be >= 0")
        need(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= 0 or self.top_k == -1, "top_k",
             "must be 0 or -1 (off) or a positive int")
        need(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1")
        need(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             "must be an int in [0, max_tokens]")
        need(self.seed is None or isinstance(self.seed, int) and not isinstance(self.seed, bool) and
             -2 ** 63 <= self.seed < 2 ** 63, "seed", "must be None or an int in [-2**63, 2**63)")
        need(isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
             "repetition_penalty", "must be > 0")
        need(isinstance(self.presence_penalty, (int, float)) and -2 <= self.presence_penalty <= 2,
             "presence_penalty", "must be in [-2, 2]")
        need(isinstance(self.frequency_penalty, (int, float)) and -2 <= self.frequency_penalty <= 2,
             "frequency_penalty", "must be in [-2, 2]")
        need(self.logprobs is None or isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20, "logprobs",
             "must be None or an int in [0, 20]")
        need(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
             "must be a string or a list of strings")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        need(all(isinstance(s, str) and s for s in stops), "stop", "must be a non-empty string or a list of them")
        need(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
             "must be a list of ints")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []), "stop_token_ids",
             "must be a list of non-negative ints")
        if self.top_k == -1:
            self.top_k = 0
        self.stop_strings = stops
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
