"""The OpenAI-compatible server through the official `openai` client: an in-process uvicorn on a free port around
the embedded tiny Qwen3-VL (float32), with an API key."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

for _module in ("fastapi", "uvicorn", "httpx"):  # the server's own dependencies, not vlinfer's
    pytest.importorskip(_module, reason="the server needs them: pip install fastapi uvicorn httpx")
openai = pytest.importorskip("openai", reason="the server tests use the official client: pip install openai")
import httpx  # noqa: E402

from vlinfer.engine.engine_loop import EngineLoop  # noqa: E402
from vlinfer.engine.llm_engine import LLMEngine  # noqa: E402
from vlinfer.serve import ServeConfig, build_app  # noqa: E402
from vlinfer.serve.testing import ServerThread, data_uri, png_bytes  # noqa: E402

MODEL = "qwen3-vl-tiny"
KEY = "test-key-0123456789"
IMAGE = data_uri(png_bytes(seed=1))


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine(MODEL, dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)
    loop = EngineLoop(engine)
    app = build_app(loop, ServeConfig(served_model_names=(MODEL,), api_key=KEY))
    try:
        with ServerThread(app) as url:
            yield SimpleNamespace(url=url, engine=engine, loop=loop, app=app)
    finally:
        loop.close()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, timeout=60, max_retries=0) as c:
        yield c


def image_messages(text="Describe the image.", image=IMAGE):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": text}]}]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "vlinfer"


def test_chat_with_image_and_usage(client, served):
    r = client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    u = r.usage
    # A 64x64 image is resized to the model's minimum 256x256: 64 image tokens, plus the chat template's text.
    assert u.prompt_tokens > 64 and u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens <= u.prompt_tokens
    again = client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=8, temperature=0)
    # The same image and text again: the prompt's full blocks come from the prefix cache.
    block = served.engine.block_manager.block_size
    assert block <= again.usage.prompt_tokens_details.cached_tokens < u.prompt_tokens
    assert again.choices[0].message.content == choice.message.content


def test_stream_joins_to_the_greedy_answer(client):
    full = client.chat.completions.create(model=MODEL, messages=image_messages("What is it?"), max_tokens=12,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=image_messages("What is it?"),
                                                 max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_ends_with_done(served):
    body = {"model": MODEL, "messages": image_messages(), "max_tokens": 3, "stream": True}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_text_completion(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_n_with_seed_is_reproducible(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6,
                  temperature=1.0, n=3, seed=7)
    a, b = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # seeds seed, seed+1, seed+2: different draws
    assert 3 <= a.usage.completion_tokens <= 18


def test_stop_string(client):
    long = client.completions.create(model=MODEL, prompt="Count:", max_tokens=12, temperature=0).choices[0].text
    stop = long[len(long) // 2:len(long) // 2 + 3]
    r = client.completions.create(model=MODEL, prompt="Count:", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert long.startswith(r.choices[0].text)


def test_bad_image_is_a_400_with_a_message(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=image_messages(image=data_uri(b"not an image")),
                                       max_tokens=4)
    assert e.value.status_code == 400
    err = e.value.body
    assert "invalid image: not a PNG / JPEG" in err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == "messages.0.content.0.image_url.url"


def test_image_urls_are_off_by_default(client):
    with pytest.raises(openai.BadRequestError, match="image URLs are disabled"):
        client.chat.completions.create(model=MODEL, messages=image_messages(image="https://example.com/a.png"),
                                       max_tokens=4)


def test_api_key_required(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="wrong-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
    assert e.value.status_code == 401 and "invalid API key" in e.value.body["message"]
    r = httpx.post(served.url + "/v1/chat/completions", json={})  # no header at all: refused before the body
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "missing API key" in r.json()["error"]["message"] and r.headers["www-authenticate"] == "Bearer"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_health(served):
    r = httpx.get(served.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the point
def test_health_is_503_when_the_engine_loop_died():
    class DyingEngine:  # its first look for work kills the loop thread, as an uncaught fatal error would
        def has_unfinished_requests(self):
            raise SystemExit

    loop = EngineLoop(DyingEngine())
    loop._thread.join(timeout=5)
    app = build_app(loop, ServeConfig(served_model_names=(MODEL,)))
    with ServerThread(app) as url:
        r = httpx.get(url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_metrics(served, client):
    for _ in range(2):  # the second one reuses the first one's prompt blocks
        client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=image_messages(image=data_uri(b"junk")), max_tokens=4)
    assert httpx.get(served.url + "/v1/models").status_code == 401
    text = httpx.get(served.url + "/metrics").text
    assert 'vlinfer_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'vlinfer_requests_total{route="/v1/chat/completions",status="400"}' in text
    assert 'vlinfer_requests_total{route="/v1/models",status="401"}' in text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["vlinfer_kv_blocks_total"] == served.engine.block_manager.num_blocks
    assert values["vlinfer_kv_blocks_used"] == 0 and values["vlinfer_encoder_cache_entries"] == 0
    assert values["vlinfer_num_requests_running"] == 0 and values["vlinfer_num_requests_waiting"] == 0
    assert values["vlinfer_prompt_tokens_total"] > 64 and values["vlinfer_generation_tokens_total"] >= 4
    assert values["vlinfer_prompt_cached_tokens_total"] > 0
    assert values["vlinfer_time_to_first_token_seconds_count"] >= 2
    assert values['vlinfer_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        values["vlinfer_time_to_first_token_seconds_count"]
    assert values["vlinfer_time_per_output_token_seconds_count"] >= 1
    assert values["vlinfer_engine_loop_alive"] == 1


def test_concurrent_requests_share_the_batch(served, client):
    """Requests from separate connections run in the same engine steps (continuous batching across clients)."""
    results, errors = [], []

    def one(i):
        try:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Story {i}"}],
                                               max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
            results.append(r.usage.completion_tokens)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    most_running, deadline = 0, time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        most_running = max(most_running, len(served.engine.scheduler.running))
        time.sleep(0.005)
    for t in threads:
        t.join(timeout=5)
    assert not errors and results == [24] * 4, errors
    assert most_running >= 2


def test_engine_failure_is_a_500_without_internals(served, client, monkeypatch):
    def failing_step():
        raise RuntimeError("simulated device fault in /secret/internal/path")

    monkeypatch.setattr(served.engine, "step", failing_step)  # the loop thread fails every request it steps
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=4)
    assert e.value.status_code == 500 and "secret" not in str(e.value.body)
    body = {"model": MODEL, "messages": image_messages(), "max_tokens": 4, "stream": True}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200  # headers went out before the fault: the error comes in the stream
    assert '"error"' in lines[-2] and "secret" not in "".join(lines) and lines[-1] == "data: [DONE]"
    monkeypatch.undo()
    r = client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=2)
    assert r.choices[0].finish_reason and served.loop.is_alive()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_cli_defaults_to_the_models_context_length(tiny_vl_with_context, tmp_path):
    """`python -m vlinfer serve --model DIR` without --max-model-len: a 2048-position model serves at 2048 (a
    fixed 4096 default used to refuse to start); a 262144-position one at 8192, fitted down to a small KV cache."""
    runs = {2048: ([], 2048), 262144: (["--kv-cache-size", "3M"], 3072)}
    servers = {}
    try:
        for positions, (extra, _) in runs.items():
            port, log = _free_port(), open(tmp_path / f"serve-{positions}.log", "w+")
            proc = subprocess.Popen([sys.executable, "-m", "vlinfer", "serve", "--model",
                                     tiny_vl_with_context(positions), "--port", str(port), "--dtype", "float32",
                                     "--log-level", "warning", *extra], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            servers[positions] = (proc, f"http://127.0.0.1:{port}", log)
        for positions, (proc, url, log) in servers.items():
            deadline = time.monotonic() + 180
            while True:
                log.seek(0)
                assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}"
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"the server did not start:\n{log.read()[-3000:]}"
                time.sleep(0.5)
            models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
            assert models[0]["max_model_len"] == runs[positions][1]
            r = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={"messages": image_messages(), "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        log = servers[262144][2]
        log.seek(0)
        assert "max_model_len=3072: the KV cache" in log.read()
    finally:
        for proc, _, log in servers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            log.close()
