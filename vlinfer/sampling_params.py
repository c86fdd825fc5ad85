import functools
from dataclasses import dataclass, field, fields, replace

from vlinfer.structured.params import StructuredOutputsParams
from vlinfer.vllm_names import did_you_mean

# alternatives per token, for logprobs and prompt_logprobs (vLLM's default max_logprobs)
MAX_LOGPROBS = 20

# vLLM SamplingParams fields vlinfer does not implement, with the value that means "off". vLLM code
# often spells out every field, so the off value is accepted (there is nothing to do); any other
# value is refused by name instead of being silently ignored.
VLLM_FIELDS_OFF = {
    "best_of": None, "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False,
    "logits_processors": None, "detokenize": True, "output_kind": None,
    "extra_args": None
}
# vLLM's older names of fields vlinfer has under their newer name: refused, naming the new one
RENAMED = {"guided_decoding": "structured_outputs=StructuredOutputsParams(json=..., regex=..., "
                              "choice=..., grammar=...) (vLLM's newer name, the same fields)"}


def _vllm_field_is_off(name: str, value, kwargs: dict) -> bool:
    if name == "best_of":  # best_of == n samples n and returns all n: what n alone does
        return value is None or value == kwargs.get("n", 1)
    if name == "logits_processors":  # None or an empty list
        return not value
    off = VLLM_FIELDS_OFF[name]
    return value is off if off is None or isinstance(off, bool) else value == off


def _named_fields_only(cls):
    """The dataclass __init__ raises a bare TypeError for an unknown keyword; this one raises a
    ValueError naming every field it cannot take (and the field a typo was probably meant to be)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        known = {f.name for f in fields(cls) if f.init}
        problems = []
        for name in [k for k in kwargs if k not in known]:
            value = kwargs.pop(name)
            if name in RENAMED:
                if value is not None:
                    problems.append(f"SamplingParams.{name} is vLLM's older name: use "
                                    f"{RENAMED[name]}")
                continue
            if name in VLLM_FIELDS_OFF:
                if not _vllm_field_is_off(name, value, kwargs):
                    problems.append(
                        f"SamplingParams.{name}={value!r} is not supported (a vLLM option vlinfer "
                        "does "
                        f"not implement; leave it unset)")
                continue
            problems.append(f"SamplingParams has no field {name!r}" + did_you_mean(name, known))
        if problems:
            raise ValueError("; ".join(problems))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_named_fields_only
@dataclass
class SamplingParams:
    """Per-request sampling options, named and defaulted as in vLLM. temperature 0 means greedy."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # None: until the context ends (max_model_len), as vLLM
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    # per prompt token after the first: its raw logprob and this many others
    prompt_logprobs: int | None = None
    n: int = 1  # completions per prompt, each with its own random stream (see for_completion)
    skip_special_tokens: bool = True
    # False: no space between two adjacent added tokens (vLLM's rule)
    spaces_between_special_tokens: bool = True
    # keep the stop string, or a stop token's text (EOS too), as vLLM
    include_stop_str_in_output: bool = False
    # keep the last k prompt tokens; -1: the last max_model_len
    truncate_prompt_tokens: int | None = None
    # token id -> added to its logit (OpenAI's range, [-100, 100])
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be generated
    # words never generated, at the start of the text or after a space
    bad_words: list[str] | None = None
    # constrain the output to a schema/regex/choice/grammar
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: after this many thinking tokens the engine writes the end of the thinking itself
    # (`</think>`) and the answer follows; needs the engine's reasoning parser. None: no limit.
    thinking_token_budget: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or \
                    value in (float("inf"), float("-inf")):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
        for name in ("top_k", "max_tokens", "min_tokens"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"SamplingParams.{name} must be an int, got {getattr(self, name)!r}")

        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        need(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature",
            "must be >= 0")
        need(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p",
            "must be in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= 0 or self.top_k == -1, "top_k",
             "must be 0 or -1 (off) or a positive int")
        need(
            isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p",
            "must be in [0, 1]")
        need(
            self.max_tokens is None or isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens", "must be None (until the context ends) or an int >= 1")
        need(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= (self.max_tokens or
                                                                          self.min_tokens),
            "min_tokens", "must be an int in [0, max_tokens]")
        need(self.seed is None or isinstance(self.seed, int) and not isinstance(self.seed, bool) and
             -2 ** 63 <= self.seed < 2 ** 63, "seed", "must be None or an int in [-2**63, 2**63)")
        need(isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
             "repetition_penalty", "must be > 0")
        need(isinstance(self.presence_penalty, (int, float)) and -2 <= self.presence_penalty <= 2,
             "presence_penalty", "must be in [-2, 2]")
        need(isinstance(self.frequency_penalty, (int, float)) and -2 <= self.frequency_penalty <= 2,
             "frequency_penalty", "must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            need(
                k is None or
                isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS, name,
                f"must be None or an int in [0, {MAX_LOGPROBS}]")
        need(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
             "must be a string or a list of strings")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        need(all(isinstance(s, str) and s for s in stops), "stop",
             "must be a non-empty string or a list of them")
        need(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
             "stop_token_ids", "must be a list of ints")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []),
             "stop_token_ids", "must be a list of non-negative ints")
        need(
            isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, "n",
            "must be an int >= 1")
        for name in ("skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            need(isinstance(getattr(self, name), bool), name, "must be True or False")
        k = self.truncate_prompt_tokens
        need(k is None or isinstance(k, int) and not isinstance(k, bool) and (k >= 1 or k == -1),
             "truncate_prompt_tokens",
             "must be None, -1 (the model's max_model_len) or an int >= 1")
        k = self.thinking_token_budget
        need(k is None or isinstance(k, int) and not isinstance(k, bool) and k >= 0,
             "thinking_token_budget", "must be None (no limit) or an int >= 0")
        if self.top_k == -1:
            self.top_k = 0
        self.stop_strings = stops
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_token_options()
        # vLLM's server and JSON configs pass it as a dict
        if isinstance(self.structured_outputs, dict):
            known = {f.name for f in fields(StructuredOutputsParams) if f.init}
            unknown = sorted(set(self.structured_outputs) - known)
            if unknown:
                raise ValueError(
                    f"SamplingParams.structured_outputs has no field(s) {unknown}; it takes "
                    f"{sorted(known)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        need(
            self.structured_outputs is None or
            isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
            "must be None or a StructuredOutputsParams")

    def _check_token_options(self) -> None:
        """logit_bias, allowed_token_ids and bad_words as vLLM takes them; normalized to a dict of
        int -> float (OpenAI's JSON keys are strings of ids) and lists. The model's vocabulary is
        checked by the engine."""
        def fail(name: str, why: str):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def token_id(key) -> int | None:
            if isinstance(key, str) and key.strip().isdigit():
                key = int(key)
            return key if isinstance(key, int) and not isinstance(key, bool) and key >= 0 else None

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "must be a dict of token id -> bias")
            bias = {}
            for key, value in self.logit_bias.items():
                if token_id(key) is None:
                    fail("logit_bias", f"has {key!r}, not a token id (a non-negative int)")
                if isinstance(value,
                              bool) or not isinstance(value,
                                                      (int, float)) or not -100 <= value <= 100:
                    fail(
                        "logit_bias",
                        f"has bias {value!r} for token {key!r}; biases are numbers in [-100, 100]")
                bias[token_id(key)] = float(value)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                fail("allowed_token_ids", "must be None or a non-empty list of token ids")
            if any(token_id(t) is None or isinstance(t, str) for t in self.allowed_token_ids):
                fail("allowed_token_ids", "must be a list of non-negative ints")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(words, (list, tuple)) or \
                    not all(isinstance(w, str) and w.strip() for w in words):
                fail("bad_words", "must be a list of words (strings with more than spaces)")
            self.bad_words = list(words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_completion(self, index: int) -> "SamplingParams":
        """The params of completion `index` of n: one completion and, when seeded, seed + index
        (vLLM's rule), so completions draw different tokens and each is reproduced alone by
        SamplingParams(seed=seed + index)."""
        seed = None if self.seed is None else (self.seed + index + 2 ** 63) % 2 ** 64 - 2 ** 63
        return replace(self, n=1, seed=seed)
