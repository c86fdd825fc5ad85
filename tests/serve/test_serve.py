"""The OpenAI-compatible server through the official `openai` client: an in-process uvicorn on a
free port around the embedded tiny Qwen3-VL (float32), with an API key."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from vlinfer import LLM, SamplingParams
from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.serve import ServeConfig, build_app
from serve_helpers import ServerThread, data_uri, png_bytes

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


@pytest.fixture(scope="module")
def offline():
    """The served engine's model and settings, offline: what a greedy request must answer, token for
    token."""
    return LLM(MODEL, dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)


def image_messages(text="Describe the image.", image=IMAGE):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": text}]}]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "vlinfer"


def test_each_route_is_in_its_familys_module():
    """One module per route family (vlinfer/serve/routes/): where a route is handled, the file name
    says; build_app includes each module's router."""
    from vlinfer.serve.routes import admin, chat, completions, pooling
    families = {"admin": ["/health", "/metrics", "/v1/models", "/v1/load_lora_adapter",
                          "/v1/unload_lora_adapter"],
                "chat": ["/v1/chat/completions"], "completions": ["/v1/completions"],
                "pooling": ["/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank",
                            "/v2/rerank"]}
    handled = {route.path: module.__name__ for module in (admin, chat, completions, pooling)
               for route in module.router.routes}
    assert handled == {path: f"vlinfer.serve.routes.{family}"
                       for family, paths in families.items() for path in paths}


def test_chat_with_image_and_usage(client, served, offline):
    r = client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=8,
                                       temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    # The answer and its counts are the offline engine's for the same conversation.
    ref = offline.chat(image_messages(), SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    u = r.usage
    # A 64x64 image is resized to the model's minimum 256x256: 64 image tokens, plus the chat
    # template's text.
    assert ref.images == [{"size": [256, 256], "num_tokens": 64}]
    assert u.prompt_tokens == len(ref.prompt_token_ids) and u.completion_tokens == len(
        ref.outputs[0].token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens <= u.prompt_tokens
    again = client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=8,
                                           temperature=0)
    # The same image and text again: the prompt's full blocks come from the prefix cache.
    block = served.engine.block_manager.block_size
    assert block <= again.usage.prompt_tokens_details.cached_tokens < u.prompt_tokens
    assert again.choices[0].message.content == choice.message.content


def test_stream_joins_to_the_greedy_answer(client):
    full = client.chat.completions.create(model=MODEL, messages=image_messages("What is it?"),
                                          max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=image_messages("What is it?"),
                                       max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert not chunks[-1].choices and chunks[
        -1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_ends_with_done(served):
    body = {"model": MODEL, "messages": image_messages(), "max_tokens": 3, "stream": True}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_text_completion(client, offline):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                  temperature=0)
    ref = offline.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6),
                           use_tqdm=False)
    assert r.object == "text_completion" and r.choices[0].text == ref[0].outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is",
                                         max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(
            t.logprob)


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # greedy: the best
        assert len(top) == 2 and top[token] == pytest.approx(logprob) == max(top.values())
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(4)]


def test_n_with_seed_is_reproducible(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                  max_tokens=6, temperature=1.0, n=3, seed=7)
    a, b = client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    # seeds seed, seed+1, seed+2: different draws
    assert len({c.message.content for c in a.choices}) > 1
    assert 3 <= a.usage.completion_tokens <= 18


def test_n_completions_preprocess_the_image_once(client, served, monkeypatch):
    """n choices share one processed prompt: its image is decoded and preprocessed once, not n
    times."""
    processor = served.engine.input_processor
    calls, process = [], processor.process_prompt
    monkeypatch.setattr(processor, "process_prompt",
                        lambda *a, **k: calls.append(1) or process(*a, **k))
    r = client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=3,
                                       temperature=1.0, n=3, seed=11)
    assert len(r.choices) == 3 and len(calls) == 1


def test_stop_string(client):
    long = client.completions.create(model=MODEL, prompt="Count:", max_tokens=12,
                                     temperature=0).choices[0].text
    stop = long[len(long) // 2:len(long) // 2 + 3]
    r = client.completions.create(model=MODEL, prompt="Count:", max_tokens=12, temperature=0,
                                  stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert long.startswith(r.choices[0].text)


def test_n_and_vllm_options_match_llm_generate(client, offline):
    """n=2 with vLLM's detokenization options: choices indexed 0..n-1, the same completions as
    LLM.generate with the same SamplingParams, and the stream rebuilds each choice."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    vllm = {
        "skip_special_tokens": True, "spaces_between_special_tokens": False,
        "include_stop_str_in_output": True
    }
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, n=2, seed=21,
                  extra_body=vllm)
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    texts = [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]
    expected = offline.chat(messages,
                            SamplingParams(n=2, seed=21, temperature=1.0, max_tokens=8, **vllm),
                            use_tqdm=False)[0]
    assert [c.text for c in expected.outputs] == texts
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {0: texts[0], 1: texts[1]}


def test_skip_special_tokens_reaches_the_text(client, served, monkeypatch):
    """The tiny model never says a special token by itself, so its second token is made
    <|box_start|> (one of the tokenizer's special tokens) at the sampler's output: skipped by
    default, in the text when asked."""
    box = served.engine.tokenizer.convert_tokens_to_ids("<|box_start|>")
    runner = served.engine.model_runner
    execute = runner.execute

    def scripted(batch):
        sampled, prompt_logprobs, pooled = execute(batch)
        return [(seq, [box] if seq.num_output_tokens == 1 else tokens, lp)
                for seq, tokens, lp in sampled], prompt_logprobs, pooled

    monkeypatch.setattr(runner, "execute", scripted)

    def texts(**extra):
        r = client.completions.create(model=MODEL, prompt="Count:", max_tokens=5, temperature=0,
                                      n=2, extra_body={"ignore_eos": True, **extra})
        assert [c.index for c in r.choices] == [0, 1]
        return [c.text for c in r.choices]

    kept, skipped = texts(skip_special_tokens=False), texts()
    assert all("<|box_start|>" in text for text in kept) and not any("<|box_start|>" in t
                                                                     for t in skipped)
    assert [text.replace("<|box_start|>", "") for text in kept] == skipped
    assert texts(skip_special_tokens=True) == skipped


def test_truncate_prompt_tokens_and_include_stop_str(client, served):
    ids = served.engine.tokenizer(
        "The quick brown fox jumps over the lazy dog and runs far away").input_ids
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 4})
    direct = client.completions.create(model=MODEL, prompt=ids[-4:], max_tokens=6, temperature=0)
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert cut.usage.prompt_tokens == 4 and whole.usage.prompt_tokens == len(ids)
    assert cut.choices[0].text == direct.choices[0].text
    # Truncated, a prompt longer than the context is served.
    over = client.chat.completions.create(model=MODEL,
                                          messages=[{"role": "user",
                                                     "content": "hello " * 3000}], max_tokens=2,
                                          temperature=0, extra_body={"truncate_prompt_tokens": 100})
    assert over.usage.prompt_tokens == 100
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 0})
    assert e.value.body["param"] == "truncate_prompt_tokens"
    long = client.completions.create(model=MODEL, prompt="Count:", max_tokens=12,
                                     temperature=0).choices[0].text
    stop = long[len(long) // 2:len(long) // 2 + 3]
    r = client.completions.create(model=MODEL, prompt="Count:", max_tokens=12, temperature=0,
                                  stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == long[:long.find(stop) +
                                                                              len(stop)]


def test_logit_bias_allowed_token_ids_and_bad_words(client, served):
    """The sampler's token options reach the engine through OpenAI's / vLLM's request fields (ids as
    JSON string keys), with the same effect as through LLM.generate; a bad id is a 400 naming the
    field."""
    base = client.completions.create(model=MODEL, prompt="Count:", max_tokens=6, temperature=0)
    first = base.choices[0].text
    favoured = served.engine.tokenizer("Count:").input_ids[0]
    biased = client.completions.create(model=MODEL, prompt="Count:", max_tokens=4, temperature=0,
                                       logit_bias={str(favoured): 100})
    assert served.engine.tokenizer(biased.choices[0].text,
                                   add_special_tokens=False).input_ids == [favoured] * 4
    allowed = client.completions.create(model=MODEL, prompt="Count:", max_tokens=3, temperature=0,
                                        extra_body={"allowed_token_ids": [favoured]})
    assert allowed.choices[0].text == biased.choices[0].text[:len(allowed.choices[0].text)]
    assert allowed.usage.completion_tokens == 3
    word = first.split()[0] if first.split() else first
    banned = client.completions.create(model=MODEL, prompt="Count:", max_tokens=6, temperature=0,
                                       extra_body={"bad_words": [word]})
    assert not banned.choices[0].text.lstrip().startswith(word)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={"-3": 1})
    assert e.value.body["param"] == "logit_bias"


def test_image_detail_sets_the_image_tokens(client):
    big = data_uri(png_bytes(seed=5, size=(800, 800)))

    def prompt_tokens(detail):
        url = {"url": big, **({"detail": detail} if detail else {})}
        r = client.chat.completions.create(
            model=MODEL, max_tokens=1, temperature=0, messages=[{
                "role": "user", "content": [{"type": "image_url", "image_url": url},
                                            {"type": "text", "text": "Hi"}]
            }])
        return r.usage.prompt_tokens

    # low: 512 x 512 pixels at most, 256 image tokens; high and auto: the model's budget, 800 x 800,
    # 625 tokens.
    low, high = prompt_tokens("low"), prompt_tokens("high")
    assert high - low == 625 - 256
    assert prompt_tokens("auto") == prompt_tokens(None) == high


def test_bad_image_is_a_400_with_a_message(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL,
                                       messages=image_messages(image=data_uri(b"not an image")),
                                       max_tokens=4)
    assert e.value.status_code == 400
    err = e.value.body
    assert "invalid image: not a PNG / JPEG" in err["message"] and err[
        "type"] == "invalid_request_error"
    assert err["param"] == "messages.0.content.0.image_url.url"


def test_image_urls_are_off_by_default(client):
    with pytest.raises(openai.BadRequestError, match="image URLs are disabled"):
        client.chat.completions.create(model=MODEL,
                                       messages=image_messages(image="https://example.com/a.png"),
                                       max_tokens=4)


def test_api_key_required(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="wrong-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
    assert e.value.status_code == 401 and "invalid API key" in e.value.body["message"]
    # no header at all: refused before the body
    r = httpx.post(served.url + "/v1/chat/completions", json={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "missing API key" in r.json(
    )["error"]["message"] and r.headers["www-authenticate"] == "Bearer"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)


def test_health(served):
    r = httpx.get(served.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# the thread's death is the point
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_is_503_when_the_engine_loop_died():
    # its first look for work kills the loop thread, as an uncaught fatal error would
    class DyingEngine:
        is_multimodal = False  # what the app reads of an engine before serving (its video limits)

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
        client.chat.completions.create(model=MODEL, messages=image_messages(), max_tokens=4,
                                       temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL,
                                       messages=image_messages(image=data_uri(b"junk")),
                                       max_tokens=4)
    assert httpx.get(served.url + "/v1/models").status_code == 401
    text = httpx.get(served.url + "/metrics").text
    assert 'vlinfer_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'vlinfer_requests_total{route="/v1/chat/completions",status="400"}' in text
    assert 'vlinfer_requests_total{route="/v1/models",status="401"}' in text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["vlinfer_kv_blocks_total"] == served.engine.block_manager.num_blocks
    assert values["vlinfer_kv_blocks_used"] == 0 and values["vlinfer_encoder_cache_entries"] == 0
    assert values["vlinfer_num_requests_running"] == 0 and values[
        "vlinfer_num_requests_waiting"] == 0
    assert values["vlinfer_prompt_tokens_total"] > 64 and values[
        "vlinfer_generation_tokens_total"] >= 4
    assert values["vlinfer_prompt_cached_tokens_total"] > 0
    assert values["vlinfer_time_to_first_token_seconds_count"] >= 2
    assert values['vlinfer_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        values["vlinfer_time_to_first_token_seconds_count"]
    assert values["vlinfer_time_per_output_token_seconds_count"] >= 1
    assert values["vlinfer_engine_loop_alive"] == 1


def test_concurrent_requests_share_the_batch(served, client, monkeypatch):
    """Requests from separate connections run in the same engine steps (continuous batching across
    clients)."""
    results, errors = [], []
    # The engine's first step waits until all four requests are queued, so they arrive while it is
    # busy however fast it runs: what is checked is that they then share steps, not how the clients'
    # timing fell out.
    all_queued, most_per_step = threading.Event(), [0]
    step = served.engine.step

    def gated_step():
        all_queued.wait(timeout=60)
        outputs = step()
        most_per_step[0] = max(most_per_step[0], len({o.request_id for o in outputs}))
        return outputs

    monkeypatch.setattr(served.engine, "step", gated_step)

    def one(i):
        try:
            r = client.chat.completions.create(model=MODEL,
                                               messages=[{"role": "user",
                                                          "content": f"Story {i}"}], max_tokens=24,
                                               temperature=0, extra_body={"ignore_eos": True})
            results.append(r.usage.completion_tokens)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while served.loop.num_active() < 4 and not errors and time.monotonic() < deadline:
        time.sleep(0.005)
    all_queued.set()
    for t in threads:
        t.join(timeout=120)
    assert not errors and results == [24] * 4, errors
    assert most_per_step[
        0] == 4, f"at most {most_per_step[0]} of the 4 requests advanced in one step"


def test_engine_failure_is_a_500_without_internals(served, client, monkeypatch):
    def failing_step():
        raise RuntimeError("simulated device fault in /secret/internal/path")

    # the loop thread fails every request it steps
    monkeypatch.setattr(served.engine, "step", failing_step)
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


@pytest.mark.slow  # a server subprocess
def test_serve_cli_defaults_to_the_models_context_length(tiny_vl_with_context, tmp_path):
    """`python -m vlinfer serve --model DIR` without --max-model-len: a 2048-position model serves
    at 2048 (a fixed 4096 default used to refuse to start); a 262144-position one at 8192, fitted
    down to a small KV cache."""
    runs = {2048: ([], 2048), 262144: (["--kv-cache-size", "3M"], 3072)}
    servers = {}
    try:
        for positions, (extra, _) in runs.items():
            port, log = _free_port(), open(tmp_path / f"serve-{positions}.log", "w+")
            proc = subprocess.Popen([
                sys.executable, "-m", "vlinfer", "serve", "--model",
                tiny_vl_with_context(positions), "--port",
                str(port), "--dtype", "float32", "--log-level", "warning", *extra
            ], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            servers[positions] = (proc, f"http://127.0.0.1:{port}", log)
        for positions, (proc, url, log) in servers.items():
            deadline = time.monotonic() + 180
            while True:
                log.seek(0)
                assert proc.poll(
                ) is None, f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}"
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic(
                ) < deadline, f"the server did not start:\n{log.read()[-3000:]}"
                time.sleep(0.5)
            models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
            assert models[0]["max_model_len"] == runs[positions][1]
            r = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={"messages": image_messages(), "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        log = servers[262144][2]
        log.seek(0)
        # the server's flag, not the keyword
        assert "--max-model-len=3072: the KV cache" in log.read()
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
