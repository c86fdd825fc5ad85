"""Engine replicas behind one OpenAI-compatible endpoint, with Ray Serve.

Each replica is a Ray actor holding one engine, its EngineLoop and the server's own FastAPI app
(vlinfer/serve/app.py, built at replica start through Serve's late-bound ingress), so the API, the
limits and the security checks are exactly the single-process server's. Ray Serve's proxy takes the
HTTP requests and routes each to a replica by queue length (its power-of-two-choices router); its
controller restarts a replica that dies or fails the health check, and the requests that replica
held fail at the proxy with an error, they do not hang.
"""
import logging
import os
import signal
import threading

from vlinfer.integrations import require_ray
from vlinfer.platform import set_process_threads

logger = logging.getLogger("vlinfer.serve")
DEPLOYMENT = "vlinfer"


class EngineReplica:
    """One engine and its app; Serve calls __serve_build_asgi_app__ after the constructor."""

    def __init__(self, model: str, engine_options: dict, config, threads: int | None = None):
        from vlinfer.engine.engine_loop import EngineLoop
        from vlinfer.engine.llm_engine import LLMEngine
        from vlinfer.serve.app import build_app
        if threads:  # the replica's share of the node's cores
            set_process_threads(threads)
        self.engine = LLMEngine(model, **engine_options)
        self.loop = EngineLoop(self.engine)
        # not `app`: the ingress wrapper has a property of that name
        self.asgi_app = build_app(self.loop, config)

    def __serve_build_asgi_app__(self):
        return self.asgi_app

    def pid(self) -> int:
        """This replica's process id (which process to look at in a node's logs and tools)."""
        return os.getpid()

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop died is replaced."""
        if not self.loop.is_alive():
            raise RuntimeError("the engine loop is not running")

    def __del__(self):
        loop, engine = getattr(self, "loop", None), getattr(self, "engine", None)
        if loop is not None:
            loop.close()
        if engine is not None:
            engine.close()


def build_deployment(model: str, engine_options: dict, config, replicas: int,
                     cpus_per_replica: float | None = None, gpus_per_replica: float = 0,
                     health_check_period_s: float = 2.0):
    """The bound Serve application: `replicas` EngineReplica actors. Each takes up to
    config.max_pending requests at once (the engine batches them); Serve queues the rest at the
    proxy."""
    ray = require_ray()
    from ray import serve
    cpus = cpus_per_replica or max(1.0, ray.cluster_resources().get("CPU", 1) // replicas)
    deployment = serve.deployment(
        serve.ingress()(EngineReplica), name=DEPLOYMENT, num_replicas=replicas,
        max_ongoing_requests=config.max_pending, health_check_period_s=health_check_period_s,
        health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus_per_replica})
    return deployment.bind(model, engine_options, config,
                           int(cpus) if not gpus_per_replica else None)


def start(model: str, engine_options: dict, config, replicas: int, host: str = "127.0.0.1",
          port: int = 8000, address: str | None = None, **deployment_options):
    """Start (or join) the Ray cluster, Serve's proxy on host:port and the replicas; returns once
    all are up."""
    ray = require_ray()
    from ray import serve
    from vlinfer.loading import resolve_model
    resolve_model(model)  # a missing model fails here, once; the embedded one is built once, here
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_deployment(model, engine_options, config, replicas, **deployment_options),
              name=DEPLOYMENT, route_prefix="/", blocking=False)


def run(model: str, engine_options: dict, config, replicas: int, host: str, port: int,
        address: str | None) -> int:
    """`vlinfer serve --ray`: serve until SIGTERM or Ctrl-C, then take the replicas down."""
    from ray import serve
    start(model, engine_options, config, replicas, host, port, address)
    logger.info("serving %s with %d replica(s) on http://%s:%d (Ray Serve)", model, replicas, host,
                port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0
