"""The HTTP routes, one module per family; serve/app.py includes each module's router.

    chat.py         POST /v1/chat/completions
    completions.py  POST /v1/completions
    pooling.py      POST /v1/embeddings, /score, /v1/score, /rerank, /v1/rerank, /v2/rerank
    admin.py        GET /health, /metrics, /v1/models; POST /v1/load_lora_adapter,
                    /v1/unload_lora_adapter

A handler reads its body (serve/body.py), checks it and queues its sequences through the app's
Server (serve/server.py, `request.app.state.server`), and builds its response from the finished or
streamed Run (serve/run.py, serve/responses.py)."""
