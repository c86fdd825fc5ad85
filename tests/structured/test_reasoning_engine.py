"""Thinking output through a real engine: the embedded tiny Qwen3-VL (random weights, Qwen3's
vocabulary) with a chat template that opens `<think>` in the generation prompt as Qwen3.5's does.
The toy never writes the tags by itself, so the tags come from the prompt, from
thinking_token_budget (the engine inserts `</think>` at exactly N thinking tokens) and from
logit_bias on `<think>` (an output that opens its own thinking). Checked: the inserted token's
position, reasoning + content against the raw tokens, JSON schemas and tools validated after the
thinking, enable_thinking=False against the template rendered by jinja2, and every surface (LLM,
Pipeline, the CLI chat's marks, the demo's folded block, the server through the `openai` client,
streamed and whole)."""
import contextlib
import importlib.util
import io
import json
import os
from pathlib import Path

from dependencies import REPO
from types import SimpleNamespace

import jinja2.sandbox
import jsonschema
import openai
import pytest

import vlinfer.multimodal
from serve_helpers import ServerThread
from vlinfer import LLM, SamplingParams
from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.loading.sources import embedded_model_path
from vlinfer.serve import ServeConfig, build_app
from vlinfer.structured.params import StructuredOutputsParams

ROOT = Path(REPO)
VL_TEMPLATE = (Path(vlinfer.multimodal.__file__).parent / "templates" /
               "qwen3_vl.jinja").read_text()
GENERATION = ("{%- if add_generation_prompt -%}\n    {{- '<|im_start|>assistant\\n' -}}\n"
              "{%- endif -%}")
# Qwen3.5's generation prompt: thinking opened unless enable_thinking is false
THINKING_GENERATION = GENERATION.replace("{%- endif -%}", (
    "{%- if enable_thinking is defined and enable_thinking is false -%}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' -}}\n    {%- else -%}\n"
    "        {{- '<think>\\n' -}}\n    {%- endif -%}\n{%- endif -%}"))
SUM = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"enum": ["x", "y"]}},
       "required": ["a", "b"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is 3 + 4?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": SUM}}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    """The embedded tiny Qwen3-VL's files with the thinking template beside them."""
    assert GENERATION in VL_TEMPLATE
    source, folder = embedded_model_path("qwen3-vl-tiny"), tmp_path_factory.mktemp("thinking")
    for name in os.listdir(source):
        os.symlink(os.path.join(source, name), folder / name)
    (folder / "chat_template.jinja").write_text(VL_TEMPLATE.replace(GENERATION,
                                                                    THINKING_GENERATION))
    return str(folder)


@pytest.fixture(scope="module")
def llm(thinking_model):
    with LLM(thinking_model, dtype="float32", max_model_len=1024, kv_cache_bytes=32 << 20) as llm:
        yield llm


@pytest.fixture(scope="module")
def ids(llm):
    parser = llm.engine.input_processor.reasoning_parser
    assert parser is not None and parser.name == "qwen3"  # chosen by default: the template thinks
    return SimpleNamespace(start=parser.start_token_id, end=parser.end_token_id)


def chat(llm, params, **kwargs):
    return llm.chat(ASK, params, use_tqdm=False, **kwargs)[0]


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_the_budget_ends_thinking_at_exactly_n_tokens(llm, ids, budget):
    out = chat(llm, SamplingParams(temperature=0, max_tokens=budget + 6,
                                   thinking_token_budget=budget))
    assert out.prompt.endswith("<|im_start|>assistant\n<think>\n")  # opened in the prompt
    tokens = out.outputs[0].token_ids
    assert ids.end not in tokens[:budget] and tokens[budget] == ids.end
    free = chat(llm, SamplingParams(temperature=0, max_tokens=budget + 6)).outputs[0]
    # without a budget the toy never ends its thinking: the end tag above was the engine's
    assert ids.end not in free.token_ids and free.text == "" and free.reasoning
    assert free.token_ids[:budget] == tokens[:budget]  # the same thinking up to the budget
    tokenizer = llm.get_tokenizer()
    c = out.outputs[0]
    assert c.reasoning == tokenizer.decode(tokens[:budget])
    # joined with the inserted tag: the raw text (a stop token's text is left out, as always)
    assert c.reasoning + "</think>" + c.text == tokenizer.decode(tokens, skip_special_tokens=True)
    sampled = chat(llm, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=budget + 4,
                                       thinking_token_budget=budget))
    for completion in sampled.outputs:
        assert completion.token_ids[budget] == ids.end and ids.end not in \
            completion.token_ids[:budget]


def test_json_schema_constrains_only_the_answer_after_thinking(llm, ids):
    params = SamplingParams(temperature=0, max_tokens=80, thinking_token_budget=3,
                            structured_outputs=StructuredOutputsParams(json=SUM))
    c = chat(llm, params).outputs[0]
    assert c.token_ids[3] == ids.end and c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), SUM)
    assert c.reasoning == llm.get_tokenizer().decode(c.token_ids[:3])


def test_an_output_that_opens_its_own_thinking(llm, ids):
    """A template that does not open the thinking (the toy's own): the output's first token may
    still be <think> (allowed beside the grammar's tokens), and then the grammar waits for
    </think>; an output that does not open it is constrained from its first token."""
    json_params = dict(temperature=0, max_tokens=80,
                       structured_outputs=StructuredOutputsParams(json=SUM))
    opens = chat(llm, SamplingParams(**json_params, thinking_token_budget=2,
                                     logit_bias={ids.start: 100}), chat_template=VL_TEMPLATE)
    assert opens.prompt.endswith("<|im_start|>assistant\n")
    c = opens.outputs[0]
    assert c.token_ids[0] == ids.start and c.token_ids[3] == ids.end
    assert c.reasoning == "<think><think>"  # two thinking tokens (the bias), then the budget
    jsonschema.validate(json.loads(c.text), SUM)
    plain = chat(llm, SamplingParams(**json_params, logit_bias={ids.start: -100}),
                 chat_template=VL_TEMPLATE).outputs[0]
    assert plain.reasoning is None and plain.token_ids[0] != ids.start
    jsonschema.validate(json.loads(plain.text), SUM)


def test_enable_thinking_false_renders_as_the_template_does(llm, thinking_model):
    out = chat(llm, SamplingParams(temperature=0, max_tokens=6),
               chat_template_kwargs={"enable_thinking": False})
    template = Path(thinking_model, "chat_template.jinja").read_text()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    assert out.prompt == env.from_string(template).render(
        messages=ASK, add_generation_prompt=True, enable_thinking=False)
    assert out.prompt.endswith("<think>\n\n</think>\n\n")
    c = out.outputs[0]
    assert c.reasoning is None and c.text == llm.get_tokenizer().decode(c.token_ids,
                                                                        skip_special_tokens=True)


def test_pipeline_and_cli_chat_show_the_thinking_apart(llm, ids, monkeypatch):
    import vlinfer.pipeline
    from vlinfer.cli import build_parser
    from vlinfer.cli.answer import THINKING_CLOSE, THINKING_OPEN, _stream_answer, thinking_kwargs
    monkeypatch.setattr(vlinfer.pipeline, "LLM", lambda model, **options: llm)  # its engine
    pipe = vlinfer.pipeline.Pipeline("thinking")
    options = dict(temperature=0, max_tokens=8, thinking_token_budget=2)
    detailed = pipe.chat(ASK, detailed=True, **options)
    assert detailed.token_ids[2] == ids.end and detailed.reasoning and \
        detailed.reasoning_content == detailed.reasoning
    assert pipe.chat(ASK, **options) == detailed.text
    off = pipe.chat(ASK, thinking=False, detailed=True, temperature=0, max_tokens=4)
    assert off.reasoning is None and ids.end not in off.token_ids
    assert "".join(pipe.stream(messages=ASK, **options)) == detailed.text
    prompt = llm.engine.chat_prompt(ASK)
    request_id = llm.engine.add_request(prompt, SamplingParams(**options))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        answer = _stream_answer(llm.engine, request_id)
    assert answer == detailed.text
    for command in (["chat"], ["generate", "hi"]):
        assert thinking_kwargs(build_parser().parse_args(command + ["--no-thinking"])) == \
            {"enable_thinking": False}
        assert thinking_kwargs(build_parser().parse_args(command)) is None
    assert printed.getvalue() == f"{THINKING_OPEN}{detailed.reasoning}{THINKING_CLOSE}" \
        f"{detailed.text}\n"


def test_demo_folds_the_thinking_and_never_sends_it_back():
    spec = importlib.util.spec_from_file_location("vlinfer_demo_reasoning", ROOT / "apps/demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    thinking, answer = demo.answer_messages("let me see", "")[0], None
    assert thinking["metadata"] == {"title": demo.THINKING_TITLE, "status": "pending"}
    thinking, answer = demo.answer_messages("let me see", "7")
    assert thinking["metadata"]["status"] == "done" and answer == {"role": "assistant",
                                                                   "content": "7"}
    history = [{"role": "user", "content": "3 + 4?"}, thinking, answer]
    assert demo.model_messages(history) == [
        {"role": "user", "content": [{"type": "text", "text": "3 + 4?"}]},
        {"role": "assistant", "content": "7"}]


# ---- the server, through the openai client ----
@pytest.fixture(scope="module")
def client(llm):
    loop = EngineLoop(llm.engine)
    # the server's default turns thinking off; requests turn it back on
    app = build_app(loop, ServeConfig(served_model_names=("thinking",),
                                      default_chat_template_kwargs={"enable_thinking": False}))
    try:
        with ServerThread(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="none",
                                                     timeout=120, max_retries=0) as c:
            yield c
    finally:
        loop.close()


THINK = {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 3}


def test_reasoning_content_whole_and_streamed(client, llm):
    kwargs = dict(model="thinking", messages=ASK, temperature=0, max_tokens=10)
    whole = client.chat.completions.create(**kwargs, extra_body=THINK).choices[0].message
    expected = chat(llm, SamplingParams(temperature=0, max_tokens=10, thinking_token_budget=3))
    assert whole.reasoning_content == expected.outputs[0].reasoning != ""
    assert whole.model_extra["reasoning"] == whole.reasoning_content
    assert whole.content == expected.outputs[0].text
    reasoning = content = ""
    for chunk in client.chat.completions.create(**kwargs, extra_body=THINK, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)
    default = client.chat.completions.create(**kwargs).choices[0].message  # the server's: off
    assert getattr(default, "reasoning_content", None) is None and default.content


def test_tool_calls_and_json_after_thinking(client):
    called = client.chat.completions.create(
        model="thinking", messages=ASK, temperature=0, max_tokens=80, tools=TOOLS,
        tool_choice="required", extra_body=THINK).choices[0]
    assert called.message.reasoning_content and called.finish_reason == "tool_calls"
    call = called.message.tool_calls[0].function
    assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), SUM)
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SUM}}
    answered = client.chat.completions.create(model="thinking", messages=ASK, temperature=0,
                                              max_tokens=80, response_format=fmt,
                                              extra_body=THINK).choices[0].message
    assert answered.reasoning_content
    jsonschema.validate(json.loads(answered.content), SUM)


def test_bad_template_kwargs_and_budgets_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs cannot set"):
        client.chat.completions.create(model="thinking", messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tools": []}})
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.chat.completions.create(model="thinking", messages=ASK, max_tokens=2,
                                       extra_body={"thinking_token_budget": -1})
