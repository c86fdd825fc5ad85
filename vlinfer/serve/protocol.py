"""The OpenAI wire format: request models (strict: "0.5" is not a number, 5.0 is not an int), the error shape, and
the response / stream chunk builders. Engine-side limits (top_p, top_k, penalties) stay in SamplingParams; only
what the OpenAI API itself bounds (temperature <= 2, n, top_logprobs) is checked here."""
import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_SEED = 2 ** 63 - 1  # torch generators take 64-bit seeds; larger ints fail deep in the engine, not as a 400
MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20  # SamplingParams' own cap


class ApiError(Exception):
    """Raised anywhere in a request; the app turns it into the OpenAI error body with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or error_type(status)


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error" if status == 500 else "service_unavailable_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type or error_type(status), "param": param,
                                 "code": code}}).encode()


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send new OpenAI fields before servers know them); known ones are strict.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None  # None: an assistant turn that only called tools
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields both endpoints share; the extras after `seed` are vLLM's extensions of the OpenAI API."""
    model: str | None = None  # optional: the served model when absent
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    mm_processor_kwargs: dict[str, int] | None = None
    logit_bias: dict[str, Any] | None = None  # OpenAI's: token id (a string in JSON) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools or self.functions or self.function_call not in (None, "none") or \
                self.tool_choice not in (None, "none", "auto"):
            return "tools", "tool and function calling is not supported by this server"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", "only response_format {\"type\": \"text\"} is supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # the OpenAI default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, self.n):
            return "best_of", "best_of other than n is not supported"
        return None


# ---- validation errors -> one clear message ----
_UNION_LABELS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "ImagePart"}


def _clean_loc(loc) -> str:
    """('messages', 0, 'content', 'list[tagged-union[...]]', 1) -> 'messages.0.content.1'"""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _UNION_LABELS or "[" in p))]
    return ".".join(parts)


def validation_error(e: ValidationError) -> ApiError:
    errors = sorted(e.errors(include_url=False), key=lambda err: -len(_clean_loc(err["loc"])))
    seen, lines = set(), []
    for err in errors:
        line = f"{_clean_loc(err['loc']) or 'body'}: {err['msg']}"
        if line not in seen:
            seen.add(line)
            lines.append(line)
    message = "; ".join(lines[:3]) + (f" (and {len(lines) - 3} more)" if len(lines) > 3 else "")
    return ApiError(400, f"invalid request: {message}", param=_clean_loc(errors[0]["loc"]) or None,
                    code="invalid_value")


def parse_body(model: type[_Strict], body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # nesting deep enough to exhaust the parser's stack
        raise ApiError(400, "the request body is not valid JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    problem = request.unsupported()
    if problem:
        raise ApiError(400, problem[1], param=problem[0], code="unsupported")
    return request


# ---- responses ----
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Logprobs:
    """Formats the engine's per-token {token_id: logprob} dicts (top-k plus the chosen token) the OpenAI way."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer = tokenizer
        self.top = top

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat(self, token_ids: list[int], entries: list[dict]) -> dict:
        content = []
        for token_id, entry in zip(token_ids, entries):
            text = self._text(token_id)
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:self.top]
            content.append({"token": text, "logprob": entry[token_id], "bytes": list(text.encode()),
                            "top_logprobs": [{"token": (t := self._text(i)), "logprob": lp,
                                              "bytes": list(t.encode())} for i, lp in top]})
        return {"content": content}

    def completion(self, token_ids: list[int], entries: list[dict], text_offset: int) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text = self._text(token_id)
            tokens.append(text)
            token_logprobs.append(entry[token_id])
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:self.top]
            tops.append({self._text(i): lp for i, lp in top})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def now() -> int:
    return int(time.time())


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
