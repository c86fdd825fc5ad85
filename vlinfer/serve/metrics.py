"""The server's Prometheus metrics, through prometheus_client: counters and histograms updated as
requests finish, and gauges read from the engine at scrape time by a collector. Every Server owns
its own CollectorRegistry (never the library's process-global default one), so two apps in one
process keep separate counts and never collide."""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Latencies on a CPU and on an accelerator span ms to minutes: one bucket set for both.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCollector:
    """Gauges of the engine's state, read when /metrics is scraped. Read without the engine lock (a
    scrape must not wait for a step): each value is one len() or attribute read, atomic under the
    GIL, possibly one step stale."""

    def __init__(self, loop, in_flight):
        self.loop, self.engine, self.in_flight = loop, loop.engine, in_flight

    def describe(self):
        # nothing at registration: collect() reads the engine, which may not be stepping yet
        return []

    def collect(self):
        engine = self.engine
        bm = engine.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        gauges = (("vlinfer_num_requests_running", "Sequences in the running batch",
                   len(engine.scheduler.running)), ("vlinfer_num_requests_waiting",
                                                    "Sequences waiting for admission",
                                                    len(engine.scheduler.waiting)),
                  ("vlinfer_num_requests_in_flight",
                   "Sequences submitted by this server and not yet done", self.in_flight()),
                  ("vlinfer_kv_blocks_total", "KV cache blocks in the pool", bm.num_blocks),
                  ("vlinfer_kv_blocks_used", "KV cache blocks held by unfinished sequences",
                   used), ("vlinfer_kv_cache_usage_ratio", "Share of KV cache blocks in use",
                           used / max(bm.num_blocks, 1)),
                  ("vlinfer_encoder_cache_entries",
                   "Vision encoder outputs held for unfinished requests",
                   len(engine.model_runner.encoder_cache)), ("vlinfer_engine_loop_alive",
                                                             "1 while the engine loop thread runs",
                                                             int(self.loop.is_alive())))
        for name, help, value in gauges:
            yield GaugeMetricFamily(name, help, value=value)
        # The family name without _total: the exposition adds it, as for every counter.
        yield CounterMetricFamily("vlinfer_num_preemptions",
                                  "Sequences preempted (recomputed later) since start",
                                  value=engine.scheduler.num_preemptions)
        yield from self._speculative(engine.speculator)

    @staticmethod
    def _speculative(spec):
        """Speculative decoding's counts (vLLM's spec_decode_* names): verifications that carried
        proposals, tokens proposed, tokens accepted, accepted tokens by position in the proposal;
        acceptance as gauges."""
        if spec.config is None:
            return
        for name, help, value in (("drafts", "Verifications of a sequence that carried proposals",
                                   spec.num_drafts), ("draft_tokens", "Tokens proposed",
                                                      spec.num_draft_tokens),
                                  ("accepted_tokens", "Proposed tokens the model accepted",
                                   spec.num_accepted_tokens)):
            yield CounterMetricFamily(f"vlinfer_spec_decode_num_{name}", help, value=value)
        per_position = CounterMetricFamily("vlinfer_spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens by their position in the proposal",
                                           labels=["position"])
        for position, value in enumerate(spec.accepted_per_position):
            per_position.add_metric([str(position)], value)
        yield per_position
        drafts, proposed = spec.num_drafts, spec.num_draft_tokens
        yield GaugeMetricFamily("vlinfer_spec_decode_acceptance_rate",
                                "Accepted / proposed tokens since start",
                                value=spec.num_accepted_tokens / proposed if proposed else 0.0)
        yield GaugeMetricFamily(
            "vlinfer_spec_decode_mean_accepted_length",
            "Tokens per verification step with proposals: accepted ones plus the model's own",
            value=1 + spec.num_accepted_tokens / drafts if drafts else 0.0)


class Metrics:
    # Label values come from a fixed set, never from the request: a scan of random paths must not
    # grow the output.
    ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/score", "/v1/score",
              "/rerank", "/v1/rerank", "/v2/rerank", "/v1/models", "/health", "/metrics")

    def __init__(self, loop, in_flight):
        """loop: the server's EngineLoop; in_flight: a callable giving the server's unfinished
        sequence count."""
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("vlinfer_requests", "HTTP responses by route and status code",
                                ("route", "status"), registry=registry)
        self.finished = Counter(
            "vlinfer_request_finish", "Sequences by finish reason (stop, length, abort; a "
            "pooling one: stop)", ("reason", ), registry=registry)
        self.prompt_tokens = Counter("vlinfer_prompt_tokens",
                                     "Prompt tokens admitted (image tokens included)",
                                     registry=registry)
        self.cached_tokens = Counter("vlinfer_prompt_cached_tokens",
                                     "Prompt tokens served from the prefix cache",
                                     registry=registry)
        self.generation_tokens = Counter("vlinfer_generation_tokens", "Tokens generated",
                                         registry=registry)
        self.ttft = Histogram("vlinfer_time_to_first_token_seconds",
                              "Request arrival to first generated token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.tpot = Histogram("vlinfer_time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, per request",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("vlinfer_e2e_request_latency_seconds",
                             "Request arrival to last generated token", buckets=LATENCY_BUCKETS,
                             registry=registry)
        registry.register(EngineCollector(loop, in_flight))

    def on_response(self, path: str, status: int, method: str) -> None:
        route = path if path in self.ROUTES else "other"
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
