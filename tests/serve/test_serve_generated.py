"""Generated hostile requests against the server (hypothesis): chat and completion bodies whose
messages, content parts, sampling fields (wrong types, out of range, huge, unicode), response
formats and tools are drawn at random, some valid and most not. The property: every answer is a 200
with a well-formed completion or a 4xx with an OpenAI-shaped error naming a field, a certainly
valid body always a 200; never a 5xx, never a hang past the client's timeout; after each batch, a
plain request still gets its usual answer, and once idle no KV block is held. The default tier's
cases are derandomized; the slow tier reruns them on fresh draws
(tests/support/hypothesis_draws.py).

The counts of cases per surface are printed (pytest -s) and asserted to be at least CASES each."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.serve import ServeConfig, build_app
from serve_helpers import ServerThread, data_uri, png_bytes

MODEL = "qwen3-vl-tiny"
CASES = 150  # per route
TIMEOUT_S = 60
IMAGE = data_uri(png_bytes(seed=4, size=(32, 32)))

junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                 st.text(max_size=20), st.lists(st.integers(-5, 10), max_size=4),
                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
# Each sampling field: a plausible value, an edge, or junk of any type.
FIELDS = {
    "max_tokens": st.integers(-3, 12) | st.just(10**9) | junk,
    "temperature": st.floats(-1, 3) | junk,
    "top_p": st.floats(-0.5, 1.5) | junk,
    "top_k": st.integers(-2, 50) | junk,
    "min_p": st.floats(-0.5, 1.5) | junk,
    "n": st.integers(-1, 20) | junk,
    "seed": st.integers(-2**65, 2**65) | junk,
    "stop": st.text(max_size=8) | st.lists(st.text(max_size=6), max_size=6) | junk,
    "presence_penalty": st.floats(-3, 3) | junk,
    "frequency_penalty": st.floats(-3, 3) | junk,
    "repetition_penalty": st.floats(-1, 3) | junk,
    "logit_bias": st.dictionaries(
        st.text(max_size=6) | st.integers(-5, 10**7).map(str), st.floats(-200, 200), max_size=3) |
    junk,
    "logprobs": st.booleans() | junk,
    "top_logprobs": st.integers(-2, 30) | junk,
    "stream": st.booleans() | junk,
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {
        "type": "json_schema"
    }, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}, {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}
    }, {"type": "regex"}]) | junk,
    "tools": st.just(
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]) |
    st.lists(junk, max_size=2) | junk,
}
texts = st.text(st.characters(codec="utf-8"), max_size=60)
parts = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}},
              st.sampled_from([IMAGE, "data:image/png;base64,AAAA", "data:,", "file:///etc/passwd",
                               "http://169.254.169.254/x.png", "not a url"]) | texts),
    st.builds(lambda k: {"type": k}, st.text(max_size=10)),
    junk)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]) | junk},
                          optional={"content": texts | st.lists(parts, max_size=3) | junk}),
    max_size=3) | junk

valid_messages = st.builds(
    lambda text, image: [{
        "role": "user", "content": ([{"type": "image_url", "image_url": {"url": IMAGE}}]
                                    if image else []) + [{"type": "text", "text": text}]
    }], texts, st.booleans())


@st.composite
def bodies(draw, chat: bool):
    """(a request body, whether it is certainly valid): half of them start from a valid one (so
    answers are checked too), the rest from anything. Certainly valid: a valid start, our model, a
    non-empty prompt and no drawn field (the fields mix junk in); such a body must get a 200."""
    body = {"model": draw(st.sampled_from([MODEL, MODEL, "other-model"]))}
    valid = draw(st.booleans())
    if chat:
        body["messages"] = draw(valid_messages if valid else messages)
    else:
        body["prompt"] = draw(texts if valid else texts |
                              st.lists(st.integers(-5, 200000), max_size=6) | junk)
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True))
    for name in names:
        body[name] = draw(FIELDS[name])
    certain = valid and body["model"] == MODEL and not names and body.get("prompt") != ""
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] < 10 ** 9:
        body["max_tokens"] = min(body["max_tokens"], 12)
    else:
        body.setdefault("max_tokens", 4)
    return body, certain


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(MODEL, dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)
    loop = EngineLoop(engine)
    try:
        with ServerThread(build_app(loop, ServeConfig(served_model_names=(MODEL,)))) as url:
            yield url, engine
    finally:
        loop.close()


def plain_answer(url: str) -> list[int]:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "A red square.", "max_tokens": 6,
              "temperature": 0}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def check(response: httpx.Response, stream: bool, valid: bool = False) -> str:
    """'ok' or 'refused'; fails on a 5xx or a malformed answer."""
    assert response.status_code < 500, response.text[:500]
    assert response.status_code == 200 or not valid, response.text[:500]  # a valid body: answered
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], error
        return "refused"
    assert response.status_code == 200
    if stream and response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert response.json()["choices"] is not None
    return "ok"


def run_cases(server, route: str, cases: int):
    url, engine = server
    before = plain_answer(url)
    outcomes = {"ok": 0, "refused": 0, "valid": 0}

    @settings(max_examples=cases, deadline=None, suppress_health_check=list(HealthCheck))
    @given(drawn=bodies(chat=route.endswith("chat/completions")))
    def one(drawn):
        body, valid = drawn
        outcomes["valid"] += valid
        # json.dumps writes NaN and Infinity as the bare words Python's json reads (not strict
        # JSON): hostile too.
        r = httpx.post(url + route, content=json.dumps(body),
                       headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
        outcomes[check(r, body.get("stream") is True, valid)] += 1

    one()
    print(f"{route}: {outcomes['ok'] + outcomes['refused']} generated cases, {outcomes}")
    assert outcomes["ok"] + outcomes["refused"] >= cases and outcomes["refused"] > 0
    assert outcomes["ok"] >= outcomes["valid"] > 0
    assert plain_answer(url) == before  # the server still answers as before
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


@pytest.mark.generated
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_generated_requests_get_a_client_error_or_an_answer(server, route):
    run_cases(server, route, CASES)
