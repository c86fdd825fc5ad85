"""OpenAI-compatible HTTP server: one engine in one EngineLoop, every connection's requests in the same batch.

A request goes: GuardMiddleware (API key, body cap) -> parse (strict pydantic) -> image URLs fetched on the event
loop (async, capped; serve/media.py) -> a worker thread decodes images, applies the chat template, validates and
queues the sequences (serve/server.py; queueing never waits for an engine step) -> outputs come back through
AsyncRequestStream (call_soon_threadsafe, no thread per request), merged per request (serve/run.py) -> JSON or
SSE (serve/responses.py). A client that goes away has its sequences aborted, which frees their KV blocks and
encoder cache entries at once. An embedding or reranker model answers /v1/embeddings, /score and /rerank the same
way (serve/pooling.py). LoRA adapters are chosen by the request's `model` (serve/lora.py). This file: the error
handlers and the routes."""
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.serve import lora, media, pooling, security
from vlinfer.serve.config import ServeConfig
from vlinfer.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from vlinfer.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, Logprobs, error_body, parse_body
from vlinfer.serve.responses import respond
from vlinfer.serve.server import Server

logger = logging.getLogger("vlinfer.serve")


def _json_content_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                       code="unsupported_media_type")


def build_app(loop: EngineLoop, config: ServeConfig) -> FastAPI:
    server = Server(loop, config)
    engine = server.engine
    app = FastAPI(title="vlinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    # ---- errors: always the OpenAI shape, never a stack trace ----
    def error(status: int, message: str, param=None, code=None, type=None, headers=None) -> Response:
        return Response(error_body(status, message, param, code, type), status_code=status,
                        media_type="application/json", headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error(e.status, e.message, e.param, e.code, e.type, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"invalid request: {loc}: {first.get('msg', 'invalid')}", loc or None, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        message = {404: f"no route {request.url.path!r}", 405: f"method {request.method} is not allowed on "
                   f"{request.url.path!r}"}.get(e.status_code, str(e.detail))
        return error(e.status_code, message, code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code),
                     headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
        return error(500, "internal server error; see the server log", code="internal_error")

    # ---- routes ----
    @app.get("/health")
    async def health():
        if not loop.is_alive():
            return error(503, "the engine loop is not running", code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        # task: what the model runs, vLLM's names ("generate", "embed", "classify": a reranker); supported_tasks:
        # what this server answers with it ("generate": chat and completions, "embed", "score": /score and /rerank)
        # LoRA adapters as vLLM lists them: a model each, `root` its folder, `parent` the base model's name.
        tasks = (["generate"] if engine.can_generate else []) + \
            {"generate": [], "embed": ["embed", "score"], "classify": ["score"]}[server.task]

        def card(name, root, parent):
            return {"id": name, "object": "model", "created": server.created, "owned_by": "vlinfer", "root": root,
                    "parent": parent, "max_model_len": engine.max_model_len, "task": server.task,
                    "supported_tasks": tasks}
        return {"object": "list", "data": [card(name, engine.source.name, None) for name in config.served_model_names]
                + [card(*adapter) for adapter in server.adapters.cards()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _json_content_type(request)
        req = parse_body(ChatCompletionRequest, await request.body())
        model, adapter = server.model(req.model)
        server.check_generates()
        media.check_mm_kwargs(req.mm_processor_kwargs, engine, config)
        fmt = Logprobs(req.top_logprobs or 0) if req.logprobs else None
        params = server.sampling_params(req, (req.top_logprobs or 0) if req.logprobs else None)
        server.check_capacity(req.n)
        sources = media.image_sources(req.messages, engine, config)
        videos = media.video_sources(media.content_lists(req.messages))
        fetched = await media.fetch_urls(sources, config.images, videos)
        run = await server.start(request, lambda: [server.chat_prompt(req.messages, sources, fetched,
                                                                      req.mm_processor_kwargs, req.tools)],
                                 params, req.n, 1, req.max_completion_tokens or req.max_tokens, adapter)
        return await respond(request, run, req, model, chat=True, fmt=fmt)

    @app.post("/v1/completions")
    async def completions(request: Request):
        _json_content_type(request)
        req = parse_body(CompletionRequest, await request.body())
        model, adapter = server.model(req.model)
        server.check_generates()
        fmt = Logprobs(req.logprobs) if req.logprobs is not None else None
        params = server.sampling_params(req, req.logprobs)
        prompts = server.completion_prompts(req.prompt)
        server.check_capacity(req.n * len(prompts))
        run = await server.start(request, lambda: prompts, params, req.n, len(prompts), req.max_tokens, adapter)
        return await respond(request, run, req, model, chat=False, fmt=fmt)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        _json_content_type(request)
        req = parse_body(pooling.EmbeddingRequest, await request.body())
        return JSONResponse(await pooling.embeddings(server, request, req))

    async def score(request: Request):
        _json_content_type(request)
        req = parse_body(pooling.ScoreRequest, await request.body())
        return JSONResponse(await pooling.score(server, request, req, request.url.path))

    async def rerank(request: Request):
        _json_content_type(request)
        req = parse_body(pooling.RerankRequest, await request.body())
        return JSONResponse(await pooling.rerank(server, request, req, request.url.path))

    # vLLM's runtime LoRA routes, off unless ServeConfig.allow_runtime_lora_updating (a 404 naming the flag)
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        server.adapters.check_runtime(request.url.path)
        _json_content_type(request)
        req = parse_body(lora.LoadLoRAAdapterRequest, await request.body())
        return PlainTextResponse(await server.adapters.load(req))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        server.adapters.check_runtime(request.url.path)
        _json_content_type(request)
        req = parse_body(lora.UnloadLoRAAdapterRequest, await request.body())
        return PlainTextResponse(server.adapters.unload(req))

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])

    # Outermost: runs before routing, so unauthenticated or oversized requests cost no parsing.
    app.add_middleware(security.GuardMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       on_response=server.metrics.on_response)
    return app
