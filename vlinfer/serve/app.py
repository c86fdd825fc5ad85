"""The app factory: one EngineLoop's Server, the error handlers, every route family's router and the
guard middleware wired into one FastAPI app; every connection's requests share the engine's batch.

A request goes: GuardMiddleware (API key, body cap; serve/security.py) -> its route (serve/routes/)
reads the body into its model (serve/body.py, serve/protocol.py) -> image URLs fetched on the event
loop (async, capped; serve/media.py) -> a worker thread decodes images, applies the chat template,
validates and queues the sequences (serve/server.py; queueing never waits for an engine step) ->
outputs come back through AsyncRequestStream (call_soon_threadsafe, no thread per request), merged
per request (serve/run.py) -> the route's JSON body or SSE chunks (serve/responses.py). A client
that goes away has its sequences aborted, which frees their KV blocks and encoder cache entries at
once. LoRA adapters are chosen by the request's `model` (serve/lora.py)."""
from fastapi import FastAPI

from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.serve import security
from vlinfer.serve.config import ServeConfig
from vlinfer.serve.errors import add_error_handlers
from vlinfer.serve.routes import admin, chat, completions, pooling
from vlinfer.serve.server import Server


def build_app(loop: EngineLoop, config: ServeConfig) -> FastAPI:
    server = Server(loop, config)
    app = FastAPI(title="vlinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server  # what every route reaches through request.app
    add_error_handlers(app)
    for routes in (admin, chat, completions, pooling):
        app.include_router(routes.router)
    # Outermost: runs before routing, so unauthenticated or oversized requests cost no parsing.
    app.add_middleware(security.GuardMiddleware, api_key=config.api_key,
                       max_body_bytes=config.max_body_bytes, on_response=server.metrics.on_response)
    return app
