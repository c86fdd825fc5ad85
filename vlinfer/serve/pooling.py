"""The pooling routes: /v1/embeddings (OpenAI's request, plus vLLM's chat-style `messages` for images and video) and
/score, /rerank (vLLM's Jina / Cohere-compatible shapes), on an embedding or a reranker model.

Their sequences go through the engine loop as the chat routes' do (Server.start_pooling, serve/run.py), one
pooling sequence per prompt, each answered by one PoolingRequestOutput. Scoring follows LLM.score (vlinfer/llm.py,
whose helpers it uses): a reranker reads each (query, document) pair in its own format, an embedding model gives
the cosine of the two items' embeddings, each item taken as given."""
import base64
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import Field

from vlinfer.llm import cosine, rerank_prompt, score_pairs
from vlinfer.serve import media
from vlinfer.serve.protocol import ApiError, ChatMessage, ContentPart, _Strict, new_id, now, pooling_usage
from vlinfer.serve.responses import finished_outputs


# ---- requests ----
class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request: `input`, one text or token-id prompt or a list of them, one embedding each; or
    vLLM's `messages`, one conversation (images and videos allowed) through the chat template, one embedding."""
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes
    dimensions: int | None = None  # PoolingParams checks it (and the model's size)
    user: str | None = None
    # vLLM's extras
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    add_generation_prompt: bool = False  # messages: vLLM's default for embeddings
    mm_processor_kwargs: dict[str, int | float | bool] | None = None
    embed_dtype: Literal["float32"] = "float32"  # vLLM's base64 options: only what OpenAI's client decodes
    endianness: Literal["native", "little"] = "native"

    def unsupported(self) -> tuple[str, str] | None:
        if (self.input is None) == (self.messages is None):
            return "input", ("send exactly one of input (text or token ids) and messages (a chat conversation, for "
                             "images and video)")
        if self.mm_processor_kwargs is not None and self.messages is None:
            return "mm_processor_kwargs", "mm_processor_kwargs applies to messages (the input field has no media)"
        return None


class ScoreMultiModal(_Strict):
    """vLLM's multimodal score item: one item's content parts (text, image_url, video_url)."""
    content: list[ContentPart] = Field(min_length=1)


ScoreItem = str | ScoreMultiModal
ScoreItems = ScoreItem | list[ScoreItem]


class _ScoreFields(_Strict):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    instruction: str | None = None  # vlinfer's: the reranker's task instruction (LLM.score's instruction=)
    # vLLM's fields these routes cannot honour: refused by name, never ignored
    mm_processor_kwargs: dict[str, Any] | None = None
    use_activation: bool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.mm_processor_kwargs is not None:
            return "mm_processor_kwargs", ("mm_processor_kwargs is not taken here: the reranker sizes images and "
                                           "videos as its own code does (vlinfer.inputs.retrieval)")
        if self.use_activation is False:
            return "use_activation", "use_activation: false (raw logits) is not supported; scores are probabilities"
        for name, items in self.sides():
            for prefix, item in _named(name, items):
                for j, part in enumerate(item.content if isinstance(item, ScoreMultiModal) else []):
                    if part.type == "image_url" and part.image_url.detail is not None:
                        return f"{prefix}.content.{j}.image_url.detail", \
                            "image_url.detail is not taken in score items: images are sized as the reranker's code does"
        return None


SCORE_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))  # vLLM's names of one pair


class ScoreRequest(_ScoreFields):
    """vLLM's /score: text_1 against text_2 (also named queries / documents or data_1 / data_2): one item against
    each of a list, or two lists pairwise."""
    text_1: ScoreItems | None = None
    text_2: ScoreItems | None = None
    queries: ScoreItems | None = None
    documents: ScoreItems | None = None
    data_1: ScoreItems | None = None
    data_2: ScoreItems | None = None

    def _given(self) -> list[tuple[str, str]]:
        return [pair for pair in SCORE_PAIRS if any(getattr(self, name) is not None for name in pair)]

    def sides(self) -> list[tuple[str, Any]]:
        """[(field, items), (field, items)] of the one pair given (empty while none is)."""
        given = self._given()
        return [(name, getattr(self, name)) for name in given[0]] if len(given) == 1 else []

    def unsupported(self) -> tuple[str, str] | None:
        given = self._given()
        if len(given) != 1:
            return "text_1", ("send one pair of fields: text_1 and text_2 (or queries and documents, or data_1 and "
                              "data_2)")
        missing = [name for name in given[0] if getattr(self, name) is None]
        if missing:
            return missing[0], f"{given[0][0]} and {given[0][1]} go together: {missing[0]} is missing"
        return super().unsupported()


class RerankRequest(_ScoreFields):
    """vLLM's /rerank (Jina / Cohere): the query against each document, best first, the top_n of them (0: all)."""
    query: ScoreItem
    documents: ScoreItems
    top_n: int = Field(0, ge=0)

    def sides(self) -> list[tuple[str, Any]]:
        return [("query", self.query), ("documents", self.documents)]


def _named(field: str, items) -> list[tuple[str, Any]]:
    """(param, item) of a field holding one item or a list of them."""
    if isinstance(items, list):
        return [(f"{field}.{i}", item) for i, item in enumerate(items)]
    return [(field, items)]


# ---- /v1/embeddings ----
async def embeddings(server, request: Request, req: EmbeddingRequest) -> dict:
    model = server.check_model(req.model)
    server.check_pooling("/v1/embeddings")
    params = server.pooling_params("embed", req.dimensions, req.normalize, req.truncate_prompt_tokens)
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
        inputs = server.completion_prompts(req.input, "input")
        single = isinstance(req.input, str) or isinstance(req.input[0], int)
        names = ["input"] if single else [f"input.{i}" for i in range(len(inputs))]
        server.check_capacity(len(names), config.max_pooling_inputs, "inputs", "input")

        def prompts():
            return inputs
    outs = await finished_outputs(request, await server.start_pooling(request, prompts, params, names))
    data = [{"index": i, "object": "embedding", "embedding": _encoded(out.outputs.embedding, req.encoding_format)}
            for i, out in enumerate(outs)]
    return {"id": new_id("embd"), "object": "list", "created": now(), "model": model, "data": data,
            "usage": pooling_usage(sum(len(out.prompt_token_ids) for out in outs))}


def _encoded(vector: list[float], encoding_format: str):
    """OpenAI's encodings: the floats, or base64 of their little-endian float32 bytes (what its client decodes)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


# ---- /score and /rerank ----
async def score(server, request: Request, req: ScoreRequest, route: str) -> dict:
    model = server.check_model(req.model)
    scores, tokens = await _scores(server, request, req, route)
    return {"id": new_id("score"), "object": "list", "created": now(), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": pooling_usage(tokens)}


async def rerank(server, request: Request, req: RerankRequest, route: str) -> dict:
    model = server.check_model(req.model)
    documents = _named("documents", req.documents)
    scores, tokens = await _scores(server, request, req, route)
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
    return {"id": new_id("rerank"), "model": model, "usage": pooling_usage(tokens),
            "results": [{"index": i, "document": _document(documents[i][1]), "relevance_score": scores[i]}
                        for i in ranked]}


def _document(item) -> dict:
    """A ranked document as vLLM echoes it: {"text"}, or a multimodal item's content parts as sent."""
    if isinstance(item, str):
        return {"text": item}
    return {"multi_modal": [part.model_dump(exclude_none=True) for part in item.content]}


async def _scores(server, request: Request, req, route: str) -> tuple[list, int]:
    """(score of each pair, prompt tokens) of the request's two sides, paired as LLM.score pairs them
    (score_pairs): one item against each of a list, or two lists pairwise."""
    task = server.check_pooling(route)
    (first, data_1), (second, data_2) = req.sides()
    firsts, seconds = _named(first, data_1), _named(second, data_2)
    try:
        pairs = list(zip(*score_pairs(firsts, seconds)))
    except ValueError as e:
        raise ApiError(400, f"{first} and {second}: {e}", param=second, code="invalid_value") from None
    if task == "embed":
        return await _embedding_scores(server, request, req, firsts, seconds, second)
    server.check_capacity(len(pairs), server.config.max_pooling_inputs, "pairs to score", second)
    params = server.pooling_params("score", truncate_prompt_tokens=req.truncate_prompt_tokens)
    policy = server.config.images
    contents = [(f"{name}.content", item.content) for name, item in firsts + seconds
                if isinstance(item, ScoreMultiModal)]
    sources = media.part_sources(contents, server.engine, server.config, second)
    fetched = await media.fetch_urls(sources, policy, media.video_sources(contents))

    def prompts():  # in the worker thread: media decoded once per item, then each pair in the reranker's format
        images = iter(media.load_images(sources, fetched, policy))
        items = {name: item if isinstance(item, str) else
                 _retrieval_item(media.template_parts(item.content, f"{name}.content", images, policy, fetched))
                 for name, item in firsts + seconds}
        out = []
        for (query, _), (document, _) in pairs:
            try:
                out.append(rerank_prompt(server.engine, items[query], items[document], req.instruction))
            except ValueError as e:
                raise ApiError(400, f"{query} and {document}: {e}", param=document, code="invalid_value") from None
        return out

    outs = await finished_outputs(request, await server.start_pooling(
        request, prompts, params, [document for _, (document, _) in pairs]))
    return [out.outputs.score for out in outs], sum(len(out.prompt_token_ids) for out in outs)


def _retrieval_item(parts: list[dict]) -> dict:
    """Template parts -> a retrieval item (vlinfer/inputs/retrieval.py): its texts, images and videos."""
    item = {}
    for part in parts:
        item.setdefault(part["type"], []).append(part[part["type"]])
    return item


async def _embedding_scores(server, request: Request, req, firsts: list, seconds: list,
                            field: str) -> tuple[list, int]:
    """An embedding model's scores: each item embedded once, as given (LLM.score), then the cosine of each pair."""
    if req.instruction is not None:
        raise ApiError(400, "instruction is for a reranker; an embedding model scores the items as given",
                       param="instruction")
    texts = []
    for name, item in firsts + seconds:
        if isinstance(item, ScoreMultiModal):
            if len(item.content) != 1 or item.content[0].type != "text":
                raise ApiError(400, f"{name}: an embedding model scores text items as given; embed images and "
                                    "videos with /v1/embeddings messages, or serve a reranker to score them",
                               param=name)
            item = item.content[0].text
        texts.extend(server.completion_prompts(item, name))  # raw text: no vision tokens typed in
    server.check_capacity(len(texts), server.config.max_pooling_inputs, "items to embed", field)
    params = server.pooling_params("embed", truncate_prompt_tokens=req.truncate_prompt_tokens)
    names = [name for name, _ in firsts + seconds]
    outs = await finished_outputs(request, await server.start_pooling(request, lambda: texts, params, names))
    a, b = score_pairs(outs[:len(firsts)], outs[len(firsts):])
    return [cosine(x, y, params) for x, y in zip(a, b)], \
        sum(len(x.prompt_token_ids) + len(y.prompt_token_ids) for x, y in zip(a, b))
