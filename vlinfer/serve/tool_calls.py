"""Tool calls of the Qwen3 family (Hermes format): the model writes

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the server answers OpenAI `tool_calls` (id, type "function", name, arguments as a JSON string).
One incremental parser serves both shapes of the answer: a stream feeds it each delta and sends what
it returns, a whole answer feeds it the text once, so the two always agree. Text outside the blocks
is content; a possible start of `<tool_call>` is held back until it is known not to be one.

A block's name is sent as soon as it is known, then its arguments as they arrive, byte for byte as
the model wrote them (so the streamed fragments join to exactly the non-streamed string), the
block's closing brace and tag held back. A block that does not start `{"name": "...", "arguments":`
is kept until it closes and then parsed whole; if it is not a call object then, it goes out as
content, as it was written. A block whose header went out stays a call even when the text ends
before its arguments do (finish_reason "length" says so).

With a named function the output is constrained to the call object alone (no tags, see
`call_schema`), so the parser starts inside a block that ends with the text. With tool_choice
"required" it is constrained to one or more tagged blocks, each a call of one of the tools
(`required_calls_grammar`; one block with parallel_tool_calls false, as vLLM), read by the same
parser as an "auto" answer."""
import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (text that must wait for
    more)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ToolCallDelta:
    """What one feed adds to the answer: content text, and per call (by index) its header and/or
    arguments."""
    content: str = ""
    # index -> {"id", "name"} (first time) and/or {"arguments"}
    calls: dict = field(default_factory=dict)

    def add_call(self, index: int, **parts) -> None:
        entry = self.calls.setdefault(index, {})
        if "arguments" in parts and "arguments" in entry:
            parts["arguments"] = entry["arguments"] + parts["arguments"]
        entry.update(parts)

    def openai(self) -> dict:
        """The chat chunk's `delta` fields."""
        delta = {}
        if self.content:
            delta["content"] = self.content
        if self.calls:
            delta["tool_calls"] = []
            for index, entry in sorted(self.calls.items()):
                item = {"index": index}
                if "id" in entry:
                    item.update(id=entry["id"], type="function")
                function = {k: entry[k] for k in ("name", "arguments") if k in entry}
                if "id" in entry:
                    function.setdefault("arguments", "")
                item["function"] = function
                delta["tool_calls"].append(item)
        return delta


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict:
        return {
            "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments}
        }


class ToolCallParser:
    """feed(delta_text) -> ToolCallDelta per arrival; finish() -> the rest once the text is
    complete. `calls` and `content` hold the whole answer so far."""

    def __init__(self, bare: bool = False, max_calls: int | None = None):
        self.bare = bare  # constrained output: one call object, no tags, ending with the text
        # parallel_tool_calls=False: 1. Blocks past it are dropped (neither calls nor content), as
        # vLLM does.
        self.max_calls = max_calls
        self._extra = False  # the open block is one past max_calls
        self.calls: list[ToolCall] = []
        self.content = ""
        self._pending = ""  # text not yet given out
        self._in_block = bare
        self._current: ToolCall | None = None  # the open block's call, once its header was read
        self._header_end = 0  # where the open block's arguments start, once its header was read
        # characters of the open block's arguments given out (from the header's end)
        self._args_sent = 0
        # whitespace right after a block is the model's separator, not content
        self._after_block = False

    # ---- public ----
    def feed(self, text: str, final: bool = False) -> ToolCallDelta:
        """The answer's next text; final: it is the last, so nothing is held back any more."""
        self._pending += text
        return self.finish() if final else self._advance(ToolCallDelta(), final=False)

    def finish(self) -> ToolCallDelta:
        delta = self._advance(ToolCallDelta(), final=True)
        if self._in_block and self._extra:
            self._pending, self._in_block = "", False
        # the text ended inside a block (a constrained call, or a truncated one)
        elif self._in_block:
            self._close_block(self._pending, delta, closed=False)
            self._pending, self._in_block = "", False
        elif self._pending:
            self._emit_content(self._pending, delta)
            self._pending = ""
        return delta

    # ---- internals ----
    def _emit_content(self, text: str, delta: ToolCallDelta) -> None:
        if self._after_block:
            text = text.lstrip()
            self._after_block = not text
        self.content += text
        delta.content += text

    def _advance(self, delta: ToolCallDelta, final: bool) -> ToolCallDelta:
        while True:
            if not self._in_block:
                at = self._pending.find(OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._pending, OPEN)
                    self._emit_content(self._pending[:len(self._pending) - keep], delta)
                    self._pending = self._pending[len(self._pending) - keep:]
                    return delta
                self._emit_content(self._pending[:at], delta)
                self._pending = self._pending[at + len(OPEN):]
                self._in_block, self._current, self._args_sent = True, None, 0
                self._extra = self.max_calls is not None and len(self.calls) >= self.max_calls
                continue
            if self._extra:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return delta  # dropped whole once it closes (or the text ends)
                self._pending = self._pending[end + len(CLOSE):]
                self._in_block, self._after_block = False, True
                continue
            if not self.bare:
                end = self._pending.find(CLOSE)
                if end >= 0:
                    self._close_block(self._pending[:end], delta)
                    self._pending = self._pending[end + len(CLOSE):]
                    self._in_block, self._after_block = False, True
                    continue
            self._stream_block(delta)
            return delta

    def _stream_block(self, delta: ToolCallDelta) -> None:
        """An open block: send its header once it is complete, then the arguments written so far,
        less whatever could still turn out to be the call object's closing brace or the closing tag.
        """
        if self._current is None:
            m = _HEADER.match(self._pending)
            if not m:
                return
            try:
                name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                return  # not a name after all: parsed whole when the block closes
            self._current = ToolCall(new_call_id(), name)
            self._header_end = m.end()
            self.calls.append(self._current)
            delta.add_call(len(self.calls) - 1, id=self._current.id, name=name)
        stable = self._pending[self._header_end:]
        if not self.bare:
            stable = stable[:len(stable) - _partial_suffix(stable, CLOSE)]
        # spaces: maybe between the arguments and the object's closing brace
        stable = stable.rstrip()
        if stable.endswith("}"):
            stable = stable[:-1].rstrip()  # maybe the object's own brace; sent when more follows
        self._send_args(stable, delta)

    def _send_args(self, upto: str, delta: ToolCallDelta) -> None:
        fresh = upto[self._args_sent:]
        if fresh:
            self._current.arguments += fresh
            self._args_sent += len(fresh)
            delta.add_call(len(self.calls) - 1, arguments=fresh)

    def _close_block(self, block: str, delta: ToolCallDelta, closed: bool = True) -> None:
        # header sent: the arguments are the rest, less the object's brace
        if self._current is not None:
            body = block[self._header_end:].rstrip()
            # a cut one: as written
            self._send_args(body[:-1].rstrip() if body.endswith("}") else body, delta)
            self._current = None
            return
        call = _parse_call(block)
        if call is None:  # not a call object: the model's text, as written
            self._emit_content(block if self.bare else OPEN + block + (CLOSE if closed else ""),
                               delta)
            return
        self.calls.append(call)
        delta.add_call(len(self.calls) - 1, id=call.id, name=call.name, arguments=call.arguments)


def _parse_call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    header = _HEADER.match(block)
    if header and "arguments" in obj:  # as written, byte for byte, as a stream sends them
        body = block[header.end():].rstrip()
        return ToolCall(new_call_id(), obj["name"],
                        body[:-1].rstrip() if body.endswith("}") else body)
    return ToolCall(new_call_id(), obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, bare: bool = False,
                     max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """A whole answer -> (content outside the blocks, the calls)."""
    parser = ToolCallParser(bare, max_calls)
    parser.feed(text, final=True)
    return parser.content, parser.calls


# ---- the constraint for tool_choice "required" / a named function ----
def call_schema(tools: list[dict], name: str | None = None) -> dict:
    """A JSON schema for one call object, {"name": ..., "arguments": {...}}: of the named function,
    or of any of the tools ("required"). Each tool's `parameters` is its arguments' schema (any
    object when it has none)."""
    def one(function: dict) -> dict:
        return {
            "type": "object", "properties": {
                "name": {"enum": [function["name"]]}, "arguments": function.get("parameters") or
                {"type": "object"}
            }, "required": ["name", "arguments"], "additionalProperties": False
        }

    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    return one(functions[0]) if len(functions) == 1 else {"anyOf": [one(f) for f in functions]}


def tag_token_ids(tokenizer) -> tuple[int | None, int | None]:
    """The ids of <tool_call> and </tool_call> where the tokenizer has each as one added token
    (Qwen3 does): the grammar must name such a token itself, since the model writes the tag as that
    token, never as its letters."""
    added = tokenizer.get_added_vocab()
    return added.get(OPEN), added.get(CLOSE)


def required_calls_grammar(tools: list[dict], parallel: bool, disable_any_whitespace: bool,
                           tag_ids: tuple[int | None, int | None] = (None, None)) -> str:
    """tool_choice "required": a Lark grammar (llguidance's) for one or more Hermes blocks (exactly
    one when not parallel), each holding a call object of one of the tools (call_schema)."""
    schema = call_schema(tools)
    if disable_any_whitespace:
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    open_tag, close_tag = (f"<[{i}]>" if i is not None else json.dumps(tag)
                           for i, tag in zip(tag_ids, (OPEN, CLOSE)))
    calls = "call (\"\\n\" call)*" if parallel else "call"
    return (f"start: {calls}\n"
            f"call: {open_tag} \"\\n\" call_object \"\\n\" {close_tag}\n"
            f"call_object: %json {json.dumps(schema)}\n")
