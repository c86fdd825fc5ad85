"""Soak: the OpenAI server (`python -m vlinfer serve`, a subprocess) under a mixed, seeded workload
for a fixed time, with the concurrency stepping through 1, 4, 16, 64, 8, 2, 32 clients (a step per
--step seconds). The mix: text and image chats, streamed and not, n = 2, JSON-schema structured
outputs, completions, clients that disconnect mid-stream, requests aborted by their client after a
moment, and requests that must be refused (400). One greedy streamed chat in ten is asked again
unstreamed: the two texts must be equal.

Every --sample seconds it reads the server's RSS (psutil) and its /metrics (KV blocks in use,
encoder-cache entries, running and waiting sequences); at the end, once idle, the same again.
Printed: requests by outcome, errors by kind, p50 / p99 latency and time to first token, the samples
over time, and the targets: RSS growth under 5% over the last two thirds of the run, 0 blocks and 0
encoder entries once idle, 0 5xx, every streamed twin equal.

    python bench/soak.py --minutes 30
    python bench/soak.py --minutes 5 --model qwen3-vl-tiny
"""
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# tests/ for serve_helpers.py (the in-process server, image data URIs); appended, so no module of
# tests/ shadows one found before it.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import common  # noqa: E402
import peers  # noqa: E402
from common import machine, table  # noqa: E402

CONCURRENCY = (1, 4, 16, 64, 8, 2, 32)
SCHEMA = {
    "type": "object", "required": ["color", "count"],
    "properties": {"color": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}}
}
KINDS = ("chat", "chat-stream", "image-chat", "n2", "structured", "completion", "disconnect",
         "abort", "refused")


def image_uri(seed: int) -> str:
    from serve_helpers import data_uri, png_bytes
    return data_uri(png_bytes(seed=seed, size=(64 + seed % 64, 48 + seed % 32)))


def request(kind: str, rng: random.Random, model: str) -> tuple[str, dict]:
    words = " ".join(
        rng.choice(["red", "blue", "square", "circle", "two", "dogs", "a", "the", "sky"])
        for _ in range(rng.randint(3, 30)))
    chat = {"model": model, "messages": [{"role": "user", "content": f"Describe: {words}"}],
            "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0, 0.8])}
    if kind in ("chat-stream", "disconnect", "abort"):
        chat["stream"] = True
    if kind == "image-chat":
        chat["messages"][0]["content"] = [{
            "type": "image_url", "image_url": {"url": image_uri(rng.randint(0, 999))}
        }, {"type": "text", "text": "What is in the picture?"}]
    if kind == "n2":
        chat.update(n=2, temperature=0.8, seed=rng.randint(0, 10 ** 6))
    if kind == "structured":
        chat["response_format"] = {
            "type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}
        }
    if kind == "refused":
        chat[rng.choice(["temperature", "max_tokens", "top_p"])] = rng.choice([-5, "hot", 10 ** 12])
    if kind == "completion":
        return "/v1/completions", {
            "model": model, "prompt": words, "max_tokens": rng.randint(4, 48), "temperature": 0
        }
    return "/v1/chat/completions", chat


class Soak:
    def __init__(self, url: str, model: str, seed: int):
        self.url, self.model, self.rng = url, model, random.Random(seed)
        self.outcomes: dict[str, int] = {}
        self.latencies, self.ttfts = [], []
        self.twins = [0, 0]  # compared, equal

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def one(self, client) -> None:
        import httpx
        kind = self.rng.choice(KINDS)
        path, body = request(kind, self.rng, self.model)
        start = time.perf_counter()
        try:
            if body.get("stream"):
                await self.stream(client, kind, path, body, start)
            else:
                r = await client.post(self.url + path, json=body)
                self.judge(kind, r.status_code, r.text)
                self.latencies.append(time.perf_counter() - start)
        except httpx.HTTPError as e:
            self.count(f"client error {type(e).__name__}")

    async def stream(self, client, kind, path, body, start) -> None:
        text, first = [], None
        async with client.stream("POST", self.url + path, json=body) as r:
            if r.status_code != 200:
                self.judge(kind, r.status_code, (await r.aread()).decode())
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                first = first or time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    self.count("stream error event")
                    return
                text += [c["delta"].get("content") or "" for c in event["choices"]]
                chunks += 1
                if kind == "disconnect" and chunks == 2:
                    self.count("disconnected")
                    return  # leaving the block closes the connection mid-stream
                if kind == "abort" and time.perf_counter() - start > 0.05:
                    self.count("aborted")
                    return
        self.count("ok")
        self.latencies.append(time.perf_counter() - start)
        if first:
            self.ttfts.append(first - start)
        if body["temperature"] == 0 and self.rng.random() < 0.1:  # its unstreamed twin
            twin = await client.post(self.url + path, json={**body, "stream": False})
            self.twins[0] += 1
            same = twin.status_code == 200 and twin.json(
            )["choices"][0]["message"]["content"] == "".join(text)
            self.twins[1] += same

    def judge(self, kind: str, status: int, text: str) -> None:
        if status >= 500:
            self.count(f"5xx {status}")
        elif kind == "refused":
            self.count("refused (as it must)" if status == 400 else f"refused case got {status}")
        elif status == 200:
            self.count("ok")
        else:
            self.count(f"{status}: {text[:80]}")

    async def clients(self, n: int, until: float) -> None:
        import httpx
        async with httpx.AsyncClient(timeout=120) as client:
            async def worker():
                while time.perf_counter() < until:
                    await self.one(client)
            await asyncio.gather(*(worker() for _ in range(n)))


def metrics(url: str) -> dict:
    import httpx
    text = httpx.get(url + "/metrics", timeout=30).text
    wanted = ("vlinfer_kv_blocks_used", "vlinfer_encoder_cache_entries",
              "vlinfer_num_requests_running", "vlinfer_num_requests_waiting")
    return {
        name: float(m.group(1))
        for name in wanted if (m := re.search(rf"^{name} (\S+)$", text, re.M))
    }


def main():
    p = common.parser(__doc__)
    p.add_argument("--model", default="qwen3-vl-tiny")
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--step", type=float, default=60, help="seconds per concurrency level")
    p.add_argument("--sample", type=float, default=60,
                   help="seconds between samples of RSS and /metrics")
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import httpx
    import psutil
    print(machine(), flush=True)
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([
        sys.executable, "-m", "vlinfer", "serve", "--model", args.model, "--port",
        str(args.port), "--max-model-len", "2048", "--kv-cache-size", "256M"
    ], stdout=subprocess.DEVNULL, stderr=open(os.path.join(peers.cache_dir(), "soak.log"), "w"))
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        proc = psutil.Process(server.pid)
        soak = Soak(url, args.model, args.seed)
        samples, start = [], time.perf_counter()
        end = start + args.minutes * 60

        async def sampler():
            while time.perf_counter() < end:
                samples.append((time.perf_counter() - start, proc.memory_info().rss, metrics(url),
                                dict(soak.outcomes)))
                await asyncio.sleep(args.sample)

        async def run():
            task = asyncio.create_task(sampler())
            level = 0
            while time.perf_counter() < end:
                n = CONCURRENCY[level % len(CONCURRENCY)]
                await soak.clients(n, min(end, time.perf_counter() + args.step))
                level += 1
            await task

        asyncio.run(run())
        time.sleep(5)  # idle: aborted and disconnected requests are gone
        idle = metrics(url)
        rss_end = proc.memory_info().rss
    finally:
        server.terminate()
        server.wait(30)
    served = sum(soak.outcomes.values())
    print(f"\n{served} requests in {args.minutes:g} min; outcomes:")
    table(["outcome", "requests"], sorted(soak.outcomes.items(), key=lambda kv: -kv[1]))
    lat, ttft = sorted(soak.latencies), sorted(soak.ttfts)

    def q(values, f):
        return f"{values[min(len(values) - 1, int(f * len(values)))]:.2f}" if values else "-"

    print(
        f"\nlatency p50 {q(lat, 0.5)} s, p99 {q(lat, 0.99)} s; time to first token p50 "
        f"{q(ttft, 0.5)} s, "
        f"p99 {q(ttft, 0.99)} s")
    print()
    table([
        "minute", "RSS (MiB)", "KV blocks used", "encoder entries", "running", "waiting",
        "requests so far"
    ], [(f"{t / 60:.1f}", f"{rss / 2 ** 20:.0f}", m.get("vlinfer_kv_blocks_used"),
         m.get("vlinfer_encoder_cache_entries"), m.get("vlinfer_num_requests_running"),
         m.get("vlinfer_num_requests_waiting"), sum(o.values())) for t, rss, m, o in samples])
    third = [rss for t, rss, _, _ in samples if t >= args.minutes * 60 / 3]
    growth = (max(third[-1], rss_end) / third[0] - 1) if third else float("nan")
    fives = sum(v for k, v in soak.outcomes.items() if k.startswith("5xx"))
    print(
        f"\ntargets: RSS growth over the last two thirds {growth:+.1%} (< 5%); idle KV blocks "
        f"{idle.get('vlinfer_kv_blocks_used')} and encoder entries "
        f"{idle.get('vlinfer_encoder_cache_entries')} (0); "
        f"5xx {fives} (0); streamed twins equal {soak.twins[1]}/{soak.twins[0]}")


if __name__ == "__main__":
    main()
