"""The pooling routes, on an embedding or a reranker model: POST /v1/embeddings (OpenAI's request,
plus vLLM's chat-style `messages` for images and video) and /score, /rerank (vLLM's Jina /
Cohere-compatible shapes, also under /v1/score, /v1/rerank, /v2/rerank).

Their sequences go through the engine loop as the chat route's do (Server.start_pooling,
serve/run.py), one pooling sequence per prompt, each answered by one PoolingRequestOutput. Scoring
follows LLM.score (vlinfer/llm.py, whose helpers it uses): a reranker reads each (query, document)
pair in its own format, an embedding model gives the cosine of the two items' embeddings, each item
taken as given."""
import base64

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vlinfer.llm import cosine, rerank_prompt, score_pairs
from vlinfer.pipeline import embedding_prompt
from vlinfer.serve import media
from vlinfer.serve.body import read_json
from vlinfer.serve.errors import ApiError
from vlinfer.serve.protocol import (EmbeddingRequest, ImagePart, ImageURL, RerankRequest,
                                    ScoreMultiModal, ScoreRequest, named_items)
from vlinfer.serve.responses import finished_outputs, new_id, now, pooling_usage

router = APIRouter()


# ---- /v1/embeddings ----
@router.post("/v1/embeddings")
async def embeddings(request: Request):
    server = request.app.state.server
    req = await read_json(request, EmbeddingRequest)
    model = server.check_model(req.model)
    server.check_pooling("/v1/embeddings")
    params = server.pooling_params("embed", req.dimensions, req.normalize,
                                   req.truncate_prompt_tokens)
    engine, config = server.engine, server.config
    if req.messages is not None:
        media.check_mm_kwargs(req.mm_processor_kwargs, engine, config)
        sources = media.image_sources(req.messages, engine, config)
        videos = media.video_sources(media.content_lists(req.messages))
        fetched = await media.fetch_urls(sources, config.images, videos)
        names = ["messages"]

        def prompts():
            return [server.chat_prompt(req.messages, sources, fetched, req.mm_processor_kwargs,
                                       add_generation_prompt=req.add_generation_prompt)]
    else:
        items = _input_items(req.input)
        if req.instruction is not None or any(isinstance(item, ScoreMultiModal)
                                              for _, item in items):
            outs = await _embed_items(server, request, items, [req.instruction] * len(items),
                                      params, "input")
            return _embeddings_response(outs, req, model)
        inputs = server.completion_prompts(req.input, "input")
        single = isinstance(req.input, str) or isinstance(req.input[0], int)
        names = ["input"] if single else [f"input.{i}" for i in range(len(inputs))]
        server.check_capacity(len(names), config.max_pooling_inputs, "inputs", "input")

        def prompts():
            return inputs
    outs = await finished_outputs(request, await server.start_pooling(request, prompts, params,
                                                                      names))
    return _embeddings_response(outs, req, model)


def _embeddings_response(outs, req, model: str) -> JSONResponse:
    data = [{"index": i, "object": "embedding",
             "embedding": _encoded(out.outputs.embedding, req.encoding_format)}
            for i, out in enumerate(outs)]
    return JSONResponse({"id": new_id("embd"), "object": "list", "created": now(), "model": model,
                         "data": data,
                         "usage": pooling_usage(sum(len(out.prompt_token_ids) for out in outs))})


def _input_items(given) -> list[tuple[str, object]]:
    """(param, item) of /v1/embeddings' input: one text, token-id list or content-part list, or a
    list of texts / token-id lists. A data-URI string is an image, as vLLM's multimodal embeddings
    take it: an item of one image_url part."""
    if isinstance(given, str) or (given and not isinstance(given[0], (str, list))):
        listed = [("input", given)]
    else:
        listed = [(f"input.{i}", item) for i, item in enumerate(given)]
    return [(name, ScoreMultiModal(content=[ImagePart(type="image_url",
                                                      image_url=ImageURL(url=item))])
             if isinstance(item, str) and item.startswith("data:image/") else
             ScoreMultiModal(content=item) if isinstance(item, list) and item and
             not isinstance(item[0], int) else item) for name, item in listed]


async def _embed_items(server, request: Request, items: list, instructions: list, params,
                       field: str) -> list:
    """Texts and content-part items (ScoreMultiModal) in the Qwen embedder's format, each with its
    instruction (None: the default), as Pipeline.embed builds them (pipeline.embedding_prompt)."""
    server.check_capacity(len(items), server.config.max_pooling_inputs, "items to embed", field)
    for name, item in items:
        if not isinstance(item, (str, ScoreMultiModal)):
            raise ApiError(400, f"{name}: token ids cannot take the embedder's format (an "
                                "instruction or media); send text", param=name)
    policy = server.config.images
    contents = [(f"{name}.content", item.content) for name, item in items
                if isinstance(item, ScoreMultiModal)]
    sources = media.part_sources(contents, server.engine, server.config, field)
    fetched = await media.fetch_urls(sources, policy, media.video_sources(contents))

    def prompts():  # in the worker thread: media decoded once, then each item's conversation
        images = iter(media.load_images(sources, fetched, policy))
        out = []
        for (name, item), instruction in zip(items, instructions):
            if isinstance(item, ScoreMultiModal):
                item = _retrieval_item(media.template_parts(item.content, f"{name}.content",
                                                            images, policy, fetched))
            try:
                out.append(embedding_prompt(server.engine, item, instruction))
            except ValueError as e:
                raise ApiError(400, f"{name}: {e}", param=name, code="invalid_value") from None
        return out

    return await finished_outputs(request, await server.start_pooling(
        request, prompts, params, [name for name, _ in items]))


def _encoded(vector: list[float], encoding_format: str):
    """OpenAI's encodings: the floats, or base64 of their little-endian float32 bytes (what its
    client decodes)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


# ---- /score and /rerank ----
@router.post("/score")
@router.post("/v1/score")
async def score(request: Request):
    server = request.app.state.server
    req = await read_json(request, ScoreRequest)
    model = server.check_model(req.model)
    scores, tokens = await _scores(server, request, req, request.url.path)
    return JSONResponse({"id": new_id("score"), "object": "list", "created": now(), "model": model,
                         "data": [{"index": i, "object": "score", "score": s}
                                  for i, s in enumerate(scores)],
                         "usage": pooling_usage(tokens)})


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request):
    server = request.app.state.server
    req = await read_json(request, RerankRequest)
    model = server.check_model(req.model)
    documents = named_items("documents", req.documents)
    scores, tokens = await _scores(server, request, req, request.url.path)
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
    return JSONResponse({"id": new_id("rerank"), "model": model, "usage": pooling_usage(tokens),
                         "results": [{"index": i, "document": _document(documents[i][1]),
                                      "relevance_score": scores[i]} for i in ranked]})


def _document(item) -> dict:
    """A ranked document as vLLM echoes it: {"text"}, or a multimodal item's content parts as
    sent."""
    if isinstance(item, str):
        return {"text": item}
    return {"multi_modal": [part.model_dump(exclude_none=True) for part in item.content]}


async def _scores(server, request: Request, req, route: str) -> tuple[list, int]:
    """(score of each pair, prompt tokens) of the request's two sides, paired as LLM.score pairs
    them (score_pairs): one item against each of a list, or two lists pairwise."""
    task = server.check_pooling(route)
    (first, data_1), (second, data_2) = req.sides()
    firsts, seconds = named_items(first, data_1), named_items(second, data_2)
    try:
        pairs = list(zip(*score_pairs(firsts, seconds)))
    except ValueError as e:
        raise ApiError(400, f"{first} and {second}: {e}", param=second,
                       code="invalid_value") from None
    if task == "embed":
        return await _embedding_scores(server, request, req, firsts, seconds, second)
    server.check_capacity(len(pairs), server.config.max_pooling_inputs, "pairs to score", second)
    params = server.pooling_params("score", truncate_prompt_tokens=req.truncate_prompt_tokens)
    policy = server.config.images
    contents = [(f"{name}.content", item.content) for name, item in firsts + seconds
                if isinstance(item, ScoreMultiModal)]
    sources = media.part_sources(contents, server.engine, server.config, second)
    fetched = await media.fetch_urls(sources, policy, media.video_sources(contents))

    # In the worker thread: media decoded once per item, then each pair in the reranker's format.
    def prompts():
        images = iter(media.load_images(sources, fetched, policy))
        items = {name: item if isinstance(item, str) else _retrieval_item(
                     media.template_parts(item.content, f"{name}.content", images, policy, fetched))
                 for name, item in firsts + seconds}
        out = []
        for (query, _), (document, _) in pairs:
            try:
                out.append(rerank_prompt(server.engine, items[query], items[document],
                                         req.instruction))
            except ValueError as e:
                raise ApiError(400, f"{query} and {document}: {e}", param=document,
                               code="invalid_value") from None
        return out

    outs = await finished_outputs(request, await server.start_pooling(
        request, prompts, params, [document for _, (document, _) in pairs]))
    return [out.outputs.score for out in outs], sum(len(out.prompt_token_ids) for out in outs)


def _retrieval_item(parts: list[dict]) -> dict:
    """Template parts -> a retrieval item (vlinfer/inputs/retrieval.py): its texts, images and
    videos."""
    item = {}
    for part in parts:
        item.setdefault(part["type"], []).append(part[part["type"]])
    return item


async def _embedding_scores(server, request: Request, req, firsts: list, seconds: list,
                            field: str) -> tuple[list, int]:
    """An embedding model's scores: each item embedded once, then the cosine of each pair. Texts
    alone are embedded as given (LLM.score); with images, videos or an instruction every item takes
    the embedder's format, the query side with the instruction (Pipeline.rerank)."""
    params = server.pooling_params("embed", truncate_prompt_tokens=req.truncate_prompt_tokens)
    media_given = any(isinstance(item, ScoreMultiModal) and
                      any(part.type != "text" for part in item.content)
                      for _, item in firsts + seconds)
    if media_given or req.instruction is not None:
        # Pipeline.rerank's way: the query side with the instruction, the documents with the default
        outs = await _embed_items(server, request, firsts + seconds,
                                  [req.instruction] * len(firsts) + [None] * len(seconds), params,
                                  field)
        a, b = score_pairs(outs[:len(firsts)], outs[len(firsts):])
        return [cosine(x, y, params) for x, y in zip(a, b)], \
            sum(len(x.prompt_token_ids) + len(y.prompt_token_ids) for x, y in zip(a, b))
    texts = []
    for name, item in firsts + seconds:
        if isinstance(item, ScoreMultiModal):
            if len(item.content) != 1:
                raise ApiError(400, f"{name}: an embedding model scores one text part as given; "
                                    "give an instruction to embed items in its format",
                               param=name)
            item = item.content[0].text
        texts.extend(server.completion_prompts(item, name))  # raw text: no vision tokens typed in
    server.check_capacity(len(texts), server.config.max_pooling_inputs, "items to embed", field)
    names = [name for name, _ in firsts + seconds]
    outs = await finished_outputs(request, await server.start_pooling(request, lambda: texts,
                                                                      params, names))
    a, b = score_pairs(outs[:len(firsts)], outs[len(firsts):])
    return [cosine(x, y, params) for x, y in zip(a, b)], \
        sum(len(x.prompt_token_ids) + len(y.prompt_token_ids) for x, y in zip(a, b))
