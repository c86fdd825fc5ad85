"""Serving benchmark: a request-rate sweep against the OpenAI-compatible server, streamed, with
Poisson arrivals.

    python bench/serving.py --url http://127.0.0.1:8000 --rates 1,2,4 --num-requests 32 --image
    cat.jpg
    python bench/serving.py --model qwen3-vl-tiny --rates 2,inf --num-requests 8     # starts its
    own server

For each rate it prints throughput and time-to-first-token / time-per-output-token percentiles
(p50/p90/p99) as a markdown table. TTFT is send -> first streamed text; TPOT is (last token - first
token) / (tokens - 1), with the token count from the final usage chunk. 'inf' sends every request at
once."""
import argparse
import asyncio
import json
import math
import os
import sys
import time
from contextlib import ExitStack

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# tests/ for serve_helpers.py (the in-process server, image data URIs); appended, so no module of
# tests/ shadows one found before it.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import common  # noqa: E402


async def one_request(client: httpx.AsyncClient, body: dict, headers: dict) -> dict:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": chunk["error"]["message"]}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
    except httpx.HTTPError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if first is None:  # nothing but empty deltas (e.g. one token that decodes to nothing)
        first = last = end
    return {"ok": True, "ttft": first - start, "e2e": end - start, "tokens": tokens,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None}


async def run_rate(url: str, rate: float, num_requests: int, body: dict, headers: dict,
                   seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # Poisson arrivals: exponential gaps with mean 1/rate; rate inf sends everything at t = 0.
    gaps = np.zeros(num_requests) if math.isinf(rate) else rng.exponential(1 / rate, num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    limits = httpx.Limits(max_connections=num_requests + 4,
                          max_keepalive_connections=num_requests + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30),
                                 limits=limits) as client:
        start = time.perf_counter()

        async def scheduled(at: float) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await one_request(client, body, headers)

        results = await asyncio.gather(*(scheduled(float(t)) for t in arrivals))
        wall = time.perf_counter() - start
    return {"rate": rate, "results": results, "wall": wall}


def percentiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (float("nan"),) * 3
    return tuple(float(np.percentile(values, q)) for q in (50, 90, 99))


def table(runs: list[dict]) -> str:
    cells = []
    for run in runs:
        ok = [r for r in run["results"] if r["ok"]]
        tokens = sum(r["tokens"] for r in ok)
        ttft = percentiles([r["ttft"] * 1e3 for r in ok])
        tpot = percentiles([r["tpot"] * 1e3 for r in ok if r["tpot"] is not None])
        rate = "inf" if math.isinf(run["rate"]) else f"{run['rate']:g}"
        cells.append((rate, len(run["results"]), len(ok), f"{run['wall']:.1f}",
                      f"{len(ok) / run['wall']:.2f}", f"{tokens / run['wall']:.1f}",
                      f"{ttft[0]:.0f} / {ttft[1]:.0f} / {ttft[2]:.0f}",
                      f"{tpot[0]:.1f} / {tpot[1]:.1f} / {tpot[2]:.1f}"))
    return common.markdown(["rate (req/s)", "requests", "ok", "wall (s)", "req/s", "output tok/s",
                            "TTFT p50 / p90 / p99 (ms)", "TPOT p50 / p90 / p99 (ms)"], cells)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None,
                   help="base URL of a running server; default: start one here")
    p.add_argument("--rates", default="1,2,4",
                   help="comma-separated request rates per second; 'inf' = all at once")
    p.add_argument("--num-requests", type=int, default=16, help="requests per rate")
    p.add_argument("--image", default=None,
                   help="an image file sent with every request (as a data URI)")
    p.add_argument("--prompt", default="Describe this image in detail.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-tokens tokens (vLLM extension)")
    p.add_argument("--api-key", default=os.environ.get("VLINFER_API_KEY"))
    common.add_seed_arg(p, help="seed of the arrival times")
    g = p.add_argument_group("own server (without --url)")
    common.add_model_arg(g, "qwen3-vl")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default="auto")
    g.add_argument("--max-model-len", type=int, default=4096)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        print(f"error: --rates must be numbers or 'inf', got {args.rates!r}", file=sys.stderr)
        return 2
    content = [{"type": "text", "text": args.prompt}]
    if args.image:
        from serve_helpers import data_uri
        with open(args.image, "rb") as f:
            mime = "image/png" if args.image.lower().endswith(".png") else "image/jpeg"
            content.insert(0, {"type": "image_url", "image_url": {"url": data_uri(f.read(), mime)}})
    body = {
        "messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with ExitStack() as stack:
        url = args.url
        if url is None:
            from vlinfer.engine.engine_loop import EngineLoop
            from vlinfer.engine.llm_engine import LLMEngine
            from vlinfer.serve import ServeConfig, build_app
            from serve_helpers import ServerThread
            engine = LLMEngine(args.model, dtype=args.dtype, device=args.device,
                               max_model_len=args.max_model_len)
            loop = EngineLoop(engine)
            stack.callback(loop.close)
            url = stack.enter_context(
                ServerThread(build_app(loop, ServeConfig(served_model_names=(args.model, )))))
            print(f"started {args.model} at {url} ({engine.device}, {engine.dtype})",
                  file=sys.stderr)
        # One unmeasured request first: first-call costs (allocations, lazy imports) are not serving
        # latency.
        warm = asyncio.run(run_rate(url.rstrip("/"), math.inf, 1, body, headers,
                                    args.seed))["results"][0]
        if not warm["ok"]:
            print(f"error: the warm-up request failed: {warm['error']}", file=sys.stderr)
            return 1
        runs = []
        for rate in rates:
            run = asyncio.run(
                run_rate(url.rstrip("/"), rate, args.num_requests, body, headers, args.seed))
            failed = [r["error"] for r in run["results"] if not r["ok"]]
            if failed:
                print(f"rate {rate:g}: {len(failed)} failed, e.g. {failed[0]}", file=sys.stderr)
            runs.append(run)
    print(f"\n{args.num_requests} requests per rate, max_tokens {args.max_tokens}, "
          f"{'image ' + os.path.basename(args.image) if args.image else 'text only'}\n")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
