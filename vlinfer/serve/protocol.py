"""The OpenAI wire format: request models (strict: "0.5" is not a number, 5.0 is not an int), the error shape, and
the response / stream chunk builders. Engine-side limits (top_p, top_k, penalties) stay in SamplingParams; only
what the OpenAI API itself bounds (temperature <= 2, n, top_logprobs) is checked here."""
import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vlinfer.sampling_params import MAX_LOGPROBS

MAX_SEED = 2 ** 63 - 1  # torch generators take 64-bit seeds; larger ints fail deep in the engine, not as a 400
MAX_STOP_SEQUENCES = 16


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


class VideoURL(_Strict):
    url: str


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON string, as the server answered it


class AssistantToolCall(_Strict):
    """A call of an earlier assistant turn, sent back with the conversation."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None: an assistant turn that only called tools
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this answers


# OpenAI's rule for function names (also what keeps a name safe inside the template's JSON and our schema).
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    mm_processor_kwargs: dict[str, int | float | bool] | None = None  # app.check_mm_kwargs checks each key's type
    logit_bias: dict[str, Any] | None = None  # OpenAI's: token id (a string in JSON) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None  # OpenAI's; vLLM takes it on completions too
    structured_outputs: dict[str, Any] | None = None  # vLLM's: StructuredOutputsParams' fields
    # vLLM's older spelling of structured_outputs: refused by name, never ignored (the output would be unconstrained)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call (OpenAI's default: True)
    functions: list[Any] | None = None
    function_call: Any = None

    def tool_problem(self) -> tuple[str, str] | None:
        """Tools, tool_choice and tool turns that cannot be served, found before any work is done."""
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            return "tools", f"tools names a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}"
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return "tool_choice", f"tool_choice names the function {choice.function.name!r}, which is not in tools " \
                                  f"({names})"
        if choice == "required" and not names:
            return "tool_choice", 'tool_choice "required" needs tools'
        for i, message in enumerate(self.messages):
            if message.tool_calls and message.role != "assistant":
                return f"messages.{i}.tool_calls", "only assistant messages carry tool_calls"
            if message.role == "tool" and message.content is None:
                return f"messages.{i}.content", "a tool message needs content: the tool's result"
            for j, call in enumerate(message.tool_calls or []):
                try:
                    json.loads(call.function.arguments)
                except json.JSONDecodeError as e:
                    return f"messages.{i}.tool_calls.{j}.function.arguments", f"arguments is not valid JSON: {e}"
        return None

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions or self.function_call not in (None, "none"):
            return "functions", "the legacy functions / function_call fields are not supported; use tools"
        problem = self.tool_problem() or _constraint_problem(self)
        if problem:
            return problem
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
        return _constraint_problem(self)


def _constraint_problem(req: _SamplingFields) -> tuple[str, str] | None:
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            return name, f"{name} is vLLM's older field; send structured_outputs: {{{name[7:]!r}: ...}}"
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema_ is None):
        return "response_format", ('response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                                   '"schema": {...}}')
    return None


# ---- validation errors -> one clear message ----
_UNION_LABELS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "ImagePart", "NamedToolChoice",
                 "ScoreMultiModal"}


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


def pooling_usage(prompt_tokens: int) -> dict:
    """The usage of an embedding or scoring request: prompt tokens only."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


class Logprobs:
    """Formats the engine's per-token {token_id: Logprob} dicts (top-k plus the chosen token) the OpenAI way: the
    same raw logprobs and token texts (Logprob.decoded_token) LLM.generate returns."""

    def __init__(self, top: int):
        self.top = top

    def _top(self, entry: dict) -> list:
        return sorted(entry.values(), key=lambda lp: -lp.logprob)[:self.top]

    def chat(self, token_ids: list[int], entries: list[dict]) -> dict:
        content = []
        for token_id, entry in zip(token_ids, entries):
            chosen = entry[token_id]
            content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                            "bytes": list(chosen.decoded_token.encode()),
                            "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                              "bytes": list(lp.decoded_token.encode())} for lp in self._top(entry)]})
        return {"content": content}

    def completion(self, token_ids: list[int], entries: list[dict], text_offset: int) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            chosen = entry[token_id]
            tokens.append(chosen.decoded_token)
            token_logprobs.append(chosen.logprob)
            tops.append({lp.decoded_token: lp.logprob for lp in self._top(entry)})
            offsets.append(text_offset)
            text_offset += len(chosen.decoded_token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def now() -> int:
    return int(time.time())


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
