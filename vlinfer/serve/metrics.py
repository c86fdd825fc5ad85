"""Prometheus text exposition (format 0.0.4) without a client library: a few counters and histograms, updated
only on the event loop thread (so no locks), plus gauges read from the engine at scrape time."""
import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latencies on a CPU and on an accelerator span ms to minutes: one bucket set for both.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(pairs: tuple) -> str:
    if not pairs:
        return ""
    escaped = (f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
               for k, v in pairs)
    return "{" + ",".join(escaped) + "}"


def _num(x: float) -> str:
    if x == math.inf:
        return "+Inf"
    return repr(float(x)) if isinstance(x, float) else str(x)


class Counter:
    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self.values: dict[tuple, float] = {}

    def inc(self, amount: float = 1, **labels) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        lines += [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())] or [f"{self.name} 0"]
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
        self.name, self.help = name, help
        self.bounds = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.bounds, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


def gauge(name: str, help: str, value: float) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name} {_num(value)}"]


class Metrics:
    # Label values come from a fixed set, never from the request: a scan of random paths must not grow the output.
    ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

    def __init__(self):
        self.requests = Counter("vlinfer_requests_total", "HTTP responses by route and status code")
        self.finished = Counter("vlinfer_request_finish_total", "Generations by finish reason (stop, length, abort)")
        self.prompt_tokens = Counter("vlinfer_prompt_tokens_total", "Prompt tokens admitted (image tokens included)")
        self.cached_tokens = Counter("vlinfer_prompt_cached_tokens_total", "Prompt tokens served from the prefix cache")
        self.generation_tokens = Counter("vlinfer_generation_tokens_total", "Tokens generated")
        self.ttft = Histogram("vlinfer_time_to_first_token_seconds", "Request arrival to first generated token")
        self.tpot = Histogram("vlinfer_time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, per request")
        self.e2e = Histogram("vlinfer_e2e_request_latency_seconds", "Request arrival to last generated token")

    def on_response(self, path: str, status: int, method: str) -> None:
        route = path if path in self.ROUTES else "other"
        self.requests.inc(route=route, status=status)

    def render(self, engine, loop, in_flight: int) -> str:
        bm = engine.block_manager
        lines = []
        for metric in (self.requests, self.finished, self.prompt_tokens, self.cached_tokens, self.generation_tokens):
            lines += metric.render()
        # Read without the engine lock (the scrape must not wait for a step): each value is one len() or
        # attribute read, atomic under the GIL, possibly one step stale.
        lines += gauge("vlinfer_num_requests_running", "Sequences in the running batch", len(engine.scheduler.running))
        lines += gauge("vlinfer_num_requests_waiting", "Sequences waiting for admission", len(engine.scheduler.waiting))
        lines += gauge("vlinfer_num_requests_in_flight", "Sequences submitted by this server and not yet done",
                       in_flight)
        lines += gauge("vlinfer_kv_blocks_total", "KV cache blocks in the pool", bm.num_blocks)
        lines += gauge("vlinfer_kv_blocks_used", "KV cache blocks held by unfinished sequences",
                       bm.num_blocks - bm.num_free_blocks)
        lines += gauge("vlinfer_kv_cache_usage_ratio", "Share of KV cache blocks in use",
                       (bm.num_blocks - bm.num_free_blocks) / max(bm.num_blocks, 1))
        lines += gauge("vlinfer_encoder_cache_entries", "Vision encoder outputs held for unfinished requests",
                       len(engine.model_runner.encoder_cache))
        lines += [f"# HELP vlinfer_num_preemptions_total Sequences preempted (recomputed later) since start",
                  "# TYPE vlinfer_num_preemptions_total counter",
                  f"vlinfer_num_preemptions_total {engine.scheduler.num_preemptions}"]
        lines += gauge("vlinfer_engine_loop_alive", "1 while the engine loop thread runs", int(loop.is_alive()))
        for metric in (self.ttft, self.tpot, self.e2e):
            lines += metric.render()
        return "\n".join(lines) + "\n"
