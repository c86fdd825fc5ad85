"""The routes about the server rather than a model's answer: GET /health, /metrics (Prometheus),
/v1/models (the served model and its LoRA adapters), and vLLM's runtime LoRA routes POST
/v1/load_lora_adapter, /v1/unload_lora_adapter (off unless ServeConfig.allow_runtime_lora_updating:
a 404 naming the flag)."""
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from vlinfer.serve.body import read_json
from vlinfer.serve.errors import ApiError
from vlinfer.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from vlinfer.serve.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    if not request.app.state.server.loop.is_alive():
        raise ApiError(503, "the engine loop is not running", code="engine_dead")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.server.metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request):
    # task: what the model runs, vLLM's names ("generate", "embed", "classify": a reranker);
    # supported_tasks: what this server answers with it ("generate": chat and completions, "embed",
    # "score": /score and /rerank). LoRA adapters as vLLM lists them: a model each, `root` its
    # folder, `parent` the base model's name.
    server = request.app.state.server
    engine = server.engine
    tasks = (["generate"] if engine.can_generate else []) + \
        {"generate": [], "embed": ["embed", "score"], "classify": ["score"]}[server.task]

    def card(name, root, parent):
        return {"id": name, "object": "model", "created": server.created, "owned_by": "vlinfer",
                "root": root, "parent": parent, "max_model_len": engine.max_model_len,
                "task": server.task, "supported_tasks": tasks}
    bases = [card(name, engine.source.name, None) for name in server.config.served_model_names]
    adapters = [card(*adapter) for adapter in server.adapters.cards()]
    return {"object": "list", "data": bases + adapters}


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    adapters = request.app.state.server.adapters
    adapters.check_runtime(request.url.path)
    req = await read_json(request, LoadLoRAAdapterRequest)
    return PlainTextResponse(await adapters.load(req))


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    adapters = request.app.state.server.adapters
    adapters.check_runtime(request.url.path)
    req = await read_json(request, UnloadLoRAAdapterRequest)
    return PlainTextResponse(adapters.unload(req))
