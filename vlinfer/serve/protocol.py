"""The request models of every route (strict pydantic: "0.5" is not a number, 5.0 is not an int):
chat, completions, embeddings, score, rerank and the LoRA routes; serve/body.py reads a body into
one, serve/errors.py is the error shape, each route's module (serve/routes/) builds its response.

Engine-side limits (top_p, top_k, penalties) stay in SamplingParams; only what the OpenAI API itself
bounds (temperature <= 2, n, top_logprobs) is checked here."""
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vlinfer.sampling_params import MAX_LOGPROBS

# torch generators take 64-bit seeds; larger ints fail deep in the engine, not as a 400
MAX_SEED = 2 ** 63 - 1
MAX_STOP_SEQUENCES = 16


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send new OpenAI fields before servers know them); known
    # ones are strict.
    model_config = ConfigDict(strict=True, extra="ignore")


# ---- message content ----
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


def _url_object(value, field: str):
    """OpenAI's {"url": ...} object; a bare URL string is a common slip, said plainly."""
    if isinstance(value, str):
        url = json.dumps(value if len(value) <= 40 else value[:40] + "...")
        raise ValueError(f"{field} must be an object {{\"url\": ...}} (OpenAI's shape), got a "
                         f"string: send {{\"type\": \"{field}\", \"{field}\": {{\"url\": {url}}}}}")
    return value


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def url_object(cls, value):
        return _url_object(value, "image_url")


class VideoURL(_Strict):
    url: str


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL

    @field_validator("video_url", mode="before")
    @classmethod
    def url_object(cls, value):
        return _url_object(value, "video_url")


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


# OpenAI's rule for function names (also what keeps a name safe inside the template's JSON and our
# schema).
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


# ---- /v1/chat/completions and /v1/completions ----
class _SamplingFields(_Strict):
    """Fields both endpoints share; the extras after `seed` are vLLM's extensions of the OpenAI
    API."""
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
    # media.check_mm_kwargs checks each key's type
    mm_processor_kwargs: dict[str, int | float | bool] | None = None
    # OpenAI's: token id (a string in JSON) -> bias in [-100, 100]
    logit_bias: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: thinking tokens before the engine ends the thinking (needs the server's reasoning
    # parser)
    thinking_token_budget: int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None  # OpenAI's; vLLM takes it on completions too
    structured_outputs: dict[str, Any] | None = None  # vLLM's: StructuredOutputsParams' fields
    # vLLM's older spelling of structured_outputs: refused by name, never ignored (the output would
    # be unconstrained)
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
    # vLLM's: more chat template variables, e.g. {"enable_thinking": false}; over the server's
    # --default-chat-template-kwargs
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_problem(self) -> tuple[str, str] | None:
        """Tools, tool_choice and tool turns that cannot be served, found before any work is
        done."""
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            twice = sorted(n for n in set(names) if names.count(n) > 1)
            return "tools", f"tools names a function twice: {twice}"
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return "tool_choice", f"tool_choice names the function {choice.function.name!r}, " \
                                  f"which is not in tools ({names})"
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
                    return f"messages.{i}.tool_calls.{j}.function.arguments", \
                        f"arguments is not valid JSON: {e}"
        return None

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions or self.function_call not in (None, "none"):
            return "functions", ("the legacy functions / function_call fields are not supported; "
                                 "use tools")
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
            return name, (f"{name} is vLLM's older field; send structured_outputs: "
                          f"{{{name[7:]!r}: ...}}")
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema" and \
            (fmt.json_schema is None or fmt.json_schema.schema_ is None):
        return "response_format", ('response_format {"type": "json_schema"} needs "json_schema": '
                                   '{"name": ..., "schema": {...}}')
    return None


# ---- /v1/embeddings, /score, /rerank ----
class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request: `input`, one text or token-id prompt or a list of them, one
    embedding each; or vLLM's `messages`, one conversation (images and videos allowed) through the
    chat template, one embedding."""
    model: str | None = None
    # text, token ids, one item's content parts (text, image_url, video_url), or data-URI images
    input: str | list[str] | list[int] | list[list[int]] | list[ContentPart] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # vlinfer's: the embedder's task instruction (Pipeline.embed's); input then takes its format
    instruction: str | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes
    dimensions: int | None = None  # PoolingParams checks it (and the model's size)
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    add_generation_prompt: bool = False  # messages: vLLM's default for embeddings
    mm_processor_kwargs: dict[str, int | float | bool] | None = None
    # vLLM's base64 options: only what OpenAI's client decodes
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "little"] = "native"

    def unsupported(self) -> tuple[str, str] | None:
        if (self.input is None) == (self.messages is None):
            return "input", ("send exactly one of input (text or token ids) and messages (a chat "
                             "conversation, for images and video)")
        if self.mm_processor_kwargs is not None and self.messages is None:
            return "mm_processor_kwargs", ("mm_processor_kwargs applies to messages (input items "
                                           "are sized as the embedder's code sizes them)")
        if self.instruction is not None and self.messages is not None:
            return "instruction", ("instruction applies to input items; messages carry their own "
                                   "system turn")
        return None


class ScoreMultiModal(_Strict):
    """vLLM's multimodal score item: one item's content parts (text, image_url, video_url)."""
    content: list[ContentPart] = Field(min_length=1)


ScoreItem = str | ScoreMultiModal
ScoreItems = ScoreItem | list[ScoreItem]


class _ScoreFields(_Strict):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    # vlinfer's: the reranker's task instruction (LLM.score's instruction=)
    instruction: str | None = None
    # vLLM's fields these routes cannot honour: refused by name, never ignored
    mm_processor_kwargs: dict[str, Any] | None = None
    use_activation: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.mm_processor_kwargs is not None:
            return "mm_processor_kwargs", ("mm_processor_kwargs is not taken here: the reranker "
                                           "sizes images and videos as its own code does "
                                           "(vlinfer.inputs.retrieval)")
        if self.use_activation is False:
            return "use_activation", ("use_activation: false (raw logits) is not supported; scores "
                                      "are probabilities")
        for name, items in self.sides():
            for prefix, item in named_items(name, items):
                for j, part in enumerate(item.content if isinstance(item, ScoreMultiModal) else []):
                    if part.type == "image_url" and part.image_url.detail is not None:
                        return f"{prefix}.content.{j}.image_url.detail", \
                            "image_url.detail is not taken in score items: images are sized as " \
                            "the reranker's code does"
        return None


# vLLM's names of one pair
SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))


class ScoreRequest(_ScoreFields):
    """vLLM's /score: text_1 against text_2 (also named queries / documents or data_1 / data_2): one
    item against each of a list, or two lists pairwise."""
    text_1: ScoreItems | None = None
    text_2: ScoreItems | None = None
    queries: ScoreItems | None = None
    documents: ScoreItems | None = None
    data_1: ScoreItems | None = None
    data_2: ScoreItems | None = None

    def _given(self) -> list[tuple[str, str]]:
        return [pair for pair in SCORE_PAIRS
                if any(getattr(self, name) is not None for name in pair)]

    def sides(self) -> list[tuple[str, Any]]:
        """[(field, items), (field, items)] of the one pair given (empty while none is)."""
        given = self._given()
        return [(name, getattr(self, name)) for name in given[0]] if len(given) == 1 else []

    def unsupported(self) -> tuple[str, str] | None:
        given = self._given()
        if len(given) != 1:
            return "text_1", ("send one pair of fields: text_1 and text_2 (or queries and "
                              "documents, or data_1 and data_2)")
        missing = [name for name in given[0] if getattr(self, name) is None]
        if missing:
            return missing[0], \
                f"{given[0][0]} and {given[0][1]} go together: {missing[0]} is missing"
        return super().unsupported()


class RerankRequest(_ScoreFields):
    """vLLM's /rerank (Jina / Cohere): the query against each document, best first, the top_n of
    them (0: all)."""
    query: ScoreItem
    documents: ScoreItems
    top_n: int = Field(0, ge=0)

    def sides(self) -> list[tuple[str, Any]]:
        return [("query", self.query), ("documents", self.documents)]


def named_items(field: str, items) -> list[tuple[str, Any]]:
    """(param, item) of a field holding one item or a list of them."""
    if isinstance(items, list):
        return [(f"{field}.{i}", item) for i, item in enumerate(items)]
    return [(field, items)]


# ---- /v1/load_lora_adapter, /v1/unload_lora_adapter ----
class LoadLoRAAdapterRequest(_Strict):
    """vLLM's /v1/load_lora_adapter body."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)

    def unsupported(self) -> None:
        return None


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's /v1/unload_lora_adapter body (its lora_int_id is not taken: the server's ids are its
    own)."""
    lora_name: str = Field(min_length=1)

    def unsupported(self) -> None:
        return None
