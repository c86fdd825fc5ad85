"""The server under load, run as `python -m vlinfer serve` in its own process (so its RSS is its
own, not the test runner's) and inspected through /metrics: 64 concurrent streaming clients with
images get the same greedy answers as offline LLM.generate, and afterwards the KV pool and encoder
cache are empty and the server's RSS is back where it was; clients that hang up mid-stream, or stop
waiting for a non-streamed answer, leave nothing running."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import openai
import psutil
import pytest

from vlinfer import LLM, SamplingParams
from serve_helpers import data_uri, png_bytes

# a load test: 64 concurrent streams: `make test-full` and CI run it, `make test` leaves it out
pytestmark = pytest.mark.slow

MODEL = "qwen3-vl-tiny"
ENGINE = dict(dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)
# the same engine
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-size", "64M"]
NUM_CLIENTS = 64
MAX_TOKENS = 16
LOAD_TIMEOUT_S = 120
STARTUP_TIMEOUT_S = 180  # imports and model load on a busy 2-core machine
IDLE_TRIM_WAIT_S = 2.0  # the server trims its heap 1 s after it goes idle


def messages(i: int) -> list[dict]:
    # Distinct images and texts: 64 different prompts, 64 different encoder cache entries.
    return [{
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": data_uri(png_bytes(seed=i))}},
                    {"type": "text", "text": f"Describe picture number {i}."}]
    }]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)  # uvicorn shuts down gracefully on SIGTERM
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "vlinfer", "serve", "--model", MODEL, *SERVER_ARGS, "--port",
                str(port), "--log-level", "warning"
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            # its own process group: _stop ends all of it
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    "the server did not start within "
                    f"{STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield SimpleNamespace(url=url, process=psutil.Process(proc.pid))
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def offline_answers():
    """Greedy answers from the offline path: its own LLM (same checkpoint, dtype and max_model_len),
    prompts built with the same chat template through engine.chat_prompt."""
    llm = LLM(MODEL, **ENGINE)
    prompts = [llm.engine.chat_prompt(messages(i)) for i in range(NUM_CLIENTS)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def engine_idle(url: str) -> bool:
    m = metrics(url)
    return all(m[name] == 0
               for name in ("vlinfer_kv_blocks_used", "vlinfer_encoder_cache_entries",
                            "vlinfer_num_requests_running", "vlinfer_num_requests_waiting",
                            "vlinfer_num_requests_in_flight"))


def wait_idle(url: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine_idle(url):
            return True
        time.sleep(0.1)
    return engine_idle(url)


def aborted(url: str) -> float:
    return metrics(url).get('vlinfer_request_finish_total{reason="abort"}', 0)


def settled_rss(s) -> int:
    """The server's RSS once idle and its idle malloc_trim has run (see Server._trim_if_idle)."""
    assert wait_idle(s.url)
    time.sleep(IDLE_TRIM_WAIT_S)
    return s.process.memory_info().rss


async def stream_one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(model=MODEL, messages=messages(i),
                                                  max_tokens=MAX_TOKENS, temperature=0, stream=True)
    text, finish = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


async def run_clients(url: str) -> list:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                  timeout=LOAD_TIMEOUT_S) as c:
        return await asyncio.wait_for(
            asyncio.gather(*(stream_one(c, i) for i in range(NUM_CLIENTS))), LOAD_TIMEOUT_S)


async def warm_up(url: str):
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                  timeout=60) as c:
        return await stream_one(c, 1000)


def test_64_concurrent_streams_match_offline_and_free_everything(served, offline_answers):
    # One request through the same client path first, so lazily imported client and server code is
    # in RSS.
    assert asyncio.run(warm_up(served.url))[1] in ("stop", "length")
    rss_before = settled_rss(served)

    most_running = 0
    start = time.monotonic()

    async def load():
        nonlocal most_running
        task = asyncio.ensure_future(run_clients(served.url))
        async with httpx.AsyncClient(timeout=10) as probe:
            while not task.done():
                text = (await probe.get(served.url + "/metrics")).text
                running = next(line for line in text.splitlines()
                               if line.startswith("vlinfer_num_requests_running"))
                most_running = max(most_running, int(float(running.split()[-1])))
                await asyncio.sleep(0.05)
        return task.result()

    results = asyncio.run(load())
    elapsed = time.monotonic() - start

    assert len(results) == NUM_CLIENTS and all(finish in ("stop", "length")
                                               for _, finish in results)
    mismatches = [
        i for i, ((text, _), ref) in enumerate(zip(results, offline_answers)) if text != ref
    ]
    assert not mismatches, f"{len(mismatches)} answers differ from offline LLM.generate, " \
                           f"e.g. #{mismatches[0]}: " \
                           f"{results[mismatches[0]][0]!r} vs {offline_answers[mismatches[0]]!r}"
    assert most_running > 8, "the clients' requests should share engine steps"
    assert wait_idle(served.url), "KV blocks, encoder cache entries or requests left after the load"
    rss_after = settled_rss(served)
    growth = (rss_after - rss_before) / rss_before
    print(f"\n64 streams in {elapsed:.1f}s, at most {most_running} running at once; server RSS "
          f"{rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB ({growth:+.1%})")
    assert growth < 0.10


def test_clients_that_hang_up_mid_stream_leave_nothing_behind(served):
    """20 streams, each long (ignore_eos, 1500 tokens); half hang up right after the opening chunk
    (the request may still be waiting or prefilling), half after the first generated text."""
    body = {
        "model": MODEL, "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True
    }

    async def hang_up(client: httpx.AsyncClient, i: int) -> bool:
        payload = {**body, "messages": messages(100 + i)}
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if i % 2 == 0 or delta.get("content"):
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(hang_up(client, i) for i in range(20))),
                                          60)

    aborted_before = aborted(served.url)
    assert all(asyncio.run(main()))
    # 20 x 1500 tokens would take minutes: only aborts empty the engine within the wait.
    assert wait_idle(served.url, timeout=10), f"after 20 hang-ups: {metrics(served.url)}"
    assert aborted(served.url) - aborted_before == 20
    r = httpx.post(served.url + "/v1/chat/completions", timeout=60,
                   json={"messages": messages(7), "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200


def test_non_streaming_clients_that_give_up_are_aborted(served):
    """Without a stream the handler is waiting, not writing: it watches for the disconnect itself.
    """
    body = {"model": MODEL, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}

    async def give_up(client: httpx.AsyncClient, i: int) -> bool:
        try:
            await client.post("/v1/chat/completions", json={**body, "messages": messages(200 + i)})
        except httpx.ReadTimeout:
            return True
        return False

    async def main():
        async with httpx.AsyncClient(base_url=served.url,
                                     timeout=httpx.Timeout(60, read=1.5)) as client:
            return await asyncio.gather(*(give_up(client, i) for i in range(5)))

    aborted_before = aborted(served.url)
    # 1500 tokens each take far longer than the 1.5 s the clients wait
    assert all(asyncio.run(main()))
    assert wait_idle(served.url, timeout=10), f"after 5 give-ups: {metrics(served.url)}"
    assert aborted(served.url) - aborted_before == 5
