"""The server's pooling routes (serve/routes/pooling.py) on a tiny random Qwen3-VL checkpoint in
float32: /v1/embeddings through the official `openai` client and with vLLM's chat-style messages,
/score and /rerank with httpx, each answer equal to LLM.embed / LLM.score / Pipeline.embed on the
same checkpoint; bad requests are 400s naming the problem while the server keeps answering;
/v1/models says what each model does. Four in-process servers: an embedder (runner "pooling"), a
reranker (vLLM's hf_overrides of the Qwen3-VL rerankers), the same checkpoint generating, and an
embedder saved without its LM head (it cannot generate)."""
import base64
import contextlib
import io
import os
import shutil
import threading
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import PIL.Image
import pytest
from videos import drawn_clip, encode

from vlinfer import LLM, Pipeline
from vlinfer.engine.engine_loop import EngineLoop
from vlinfer.engine.llm_engine import LLMEngine
from vlinfer.inputs.retrieval import EMBED_INSTRUCTION, embedding_messages, mm_processor_kwargs
from vlinfer.pooling_params import PoolingParams
from vlinfer.serve import ServeConfig, build_app
from serve_helpers import ServerThread, data_uri, png_bytes

MODEL = "tiny-retrieval"
KEY = "test-key-0123456789"
OPTIONS = dict(dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)
RERANKER = dict(
    runner="pooling", hf_overrides={
        "architectures": ["Qwen3VLForSequenceClassification"],
        "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True
    })
MAX_BODY = 1 << 20
PNG = png_bytes(seed=4)
IMAGE = data_uri(PNG)
TEXTS = ["A cat sits on the mat.", "Paris is the capital of France.", "hello"]


def pil(data: bytes = PNG) -> PIL.Image.Image:
    return PIL.Image.open(io.BytesIO(data))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
    folder = build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("retrieval")), seed=0,
                                 tie_word_embeddings=False)
    headless = str(tmp_path_factory.mktemp("headless"))
    shutil.copytree(folder, headless, dirs_exist_ok=True)
    weights = os.path.join(headless, "model.safetensors")
    tensors = load_file(weights)
    del tensors["lm_head.weight"]  # an embedder saved without its LM head
    save_file(tensors, weights, metadata={"format": "pt"})
    return SimpleNamespace(folder=folder, headless=headless)


@pytest.fixture(scope="module")
def servers(checkpoints):
    kinds = {
        "embed": (checkpoints.folder, {"runner": "pooling"}),
        "rerank": (checkpoints.folder, RERANKER), "generate": (checkpoints.folder, {}),
        "headless": (checkpoints.headless, {})
    }
    with contextlib.ExitStack() as stack:
        served = {}
        for kind, (folder, options) in kinds.items():
            engine = LLMEngine(folder, **OPTIONS, **options)
            loop = EngineLoop(engine)
            stack.callback(loop.close)
            app = build_app(
                loop, ServeConfig(served_model_names=(MODEL, ), api_key=KEY,
                                  max_body_bytes=MAX_BODY))
            served[kind] = SimpleNamespace(url=stack.enter_context(ServerThread(app)),
                                           engine=engine, loop=loop)
        yield served


@pytest.fixture(scope="module")
def embedder(checkpoints):
    """The embedding model offline: Pipeline.embed (the Qwen embedder's format) and its LLM (prompts
    as given)."""
    return Pipeline(checkpoints.folder, runner="pooling", **OPTIONS)


@pytest.fixture(scope="module")
def reranker(checkpoints):
    return LLM(checkpoints.folder, **OPTIONS, **RERANKER)


@pytest.fixture(scope="module")
def client(servers):
    with openai.OpenAI(base_url=servers["embed"].url + "/v1", api_key=KEY, timeout=60,
                       max_retries=0) as c:
        yield c


def post(server, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60, **kwargs)


def close(a, b, tol=1e-6) -> bool:
    return len(a) == len(b) and float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) <= tol


def assert_idle(server) -> None:
    """Nothing left in the engine: every sequence finished or was never queued."""
    bm = server.engine.block_manager
    assert server.loop.num_active() == 0 and not server.engine.requests
    assert bm.num_free_blocks == bm.num_blocks


# ---- /v1/models ----
def test_models_show_the_task(servers):
    expected = {
        "embed": ("embed", ["generate", "embed",
                            "score"]), "rerank": ("classify", ["generate", "score"]),
        "generate": ("generate", ["generate"]), "headless": ("embed", ["embed", "score"])
    }
    for kind, (task, supported) in expected.items():
        card = httpx.get(servers[kind].url + "/v1/models",
                         headers={"Authorization": f"Bearer {KEY}"}).json()
        assert card["data"][0]["task"] == task and card["data"][0][
            "supported_tasks"] == supported, kind


# ---- /v1/embeddings ----
def test_embeddings_equal_llm_embed(client, embedder):
    ref = embedder.llm.embed(TEXTS, use_tqdm=False)
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == MODEL and [d.index for d in r.data] == [0, 1, 2]
    for d, out in zip(r.data, ref):
        assert d.object == "embedding" and close(d.embedding, out.outputs.embedding)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(
        len(o.prompt_token_ids) for o in ref)
    one = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1 and close(one.data[0].embedding, ref[1].outputs.embedding)


def test_token_id_inputs(client, embedder):
    ids = [[9707, 1879, 13], [40, 1079]]
    ref = embedder.llm.embed(ids, use_tqdm=False)
    r = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert all(close(d.embedding, o.outputs.embedding) for d, o in zip(r.data, ref))
    single = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert close(single.data[0].embedding,
                 ref[0].outputs.embedding) and single.usage.prompt_tokens == 3


def test_base64_is_little_endian_float32(client, embedder):
    ref = embedder.llm.embed(TEXTS, use_tqdm=False)
    # Without encoding_format the client asks for base64 and decodes it itself.
    decoded = client.embeddings.create(model=MODEL, input=TEXTS)
    assert all(close(d.embedding, o.outputs.embedding) for d, o in zip(decoded.data, ref))
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    for d, out in zip(raw.data, ref):
        assert isinstance(d.embedding, str)
        assert close(np.frombuffer(base64.b64decode(d.embedding), dtype="<f4"),
                     out.outputs.embedding)


def test_dimensions(client, embedder):
    ref = embedder.llm.embed(TEXTS, PoolingParams(dimensions=8), use_tqdm=False)
    for encoding in ("float", "base64"):
        # base64: the client decodes
        kwargs = {"encoding_format": "float"} if encoding == "float" else {}
        r = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=8, **kwargs)
        for d, out in zip(r.data, ref):
            assert len(d.embedding) == 8 and close(d.embedding, out.outputs.embedding)
            assert abs(float(np.linalg.norm(d.embedding)) - 1) < 1e-5  # renormalized after the cut


def test_chat_style_embedding_with_an_image(servers, embedder):
    """vLLM's messages: one embedding of the conversation, the image from a data URI."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                             {"type": "text", "text": "A photo."}]}]
    r = post(servers["embed"], "/v1/embeddings", {"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    prompt = embedder.engine.chat_prompt(
        [{
            "role": "user", "content": [{"type": "image", "image": pil()},
                                        {"type": "text", "text": "A photo."}]
        }],
        # vLLM's default for embeddings
        add_generation_prompt=False)
    ref = embedder.llm.embed(prompt, use_tqdm=False)[0]
    assert close(r.json()["data"][0]["embedding"], ref.outputs.embedding)
    # the image's tokens counted
    assert r.json()["usage"]["prompt_tokens"] == len(ref.prompt_token_ids) > 64
    # The Qwen embedder's own format (Pipeline.embed): the instruction as the system turn, the
    # generation prompt, its image sizes; the same vector through the server.
    qwen = [{"role": "system", "content": [{"type": "text", "text": EMBED_INSTRUCTION}]}, *messages]
    options = mm_processor_kwargs(embedding_messages({"image": pil()}))
    r = post(
        servers["embed"], "/v1/embeddings", {
            "model": MODEL, "messages": qwen, "add_generation_prompt": True,
            "mm_processor_kwargs": options, "dimensions": 16
        })
    assert r.status_code == 200, r.text
    ref, = embedder.embed(items=[{"image": pil(), "text": "A photo."}], dimensions=16)
    assert close(r.json()["data"][0]["embedding"], ref)


# ---- /score and /rerank ----
DOCUMENTS = [
    "The capital of France is Paris.", "Cats purr.", {
        "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                    {"type": "text", "text": "A photo."}]
    }
]
OFFLINE_DOCUMENTS = [DOCUMENTS[0], DOCUMENTS[1], {"image": pil(), "text": "A photo."}]


def test_rerank_on_the_reranker(servers, reranker):
    query = "What is the capital of France?"
    ref = [o.outputs.score for o in reranker.score(query, OFFLINE_DOCUMENTS, use_tqdm=False)]
    tokens = sum(
        len(o.prompt_token_ids) for o in reranker.score(query, OFFLINE_DOCUMENTS, use_tqdm=False))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = post(servers["rerank"], path, {"model": MODEL, "query": query, "documents": DOCUMENTS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == MODEL and body["id"].startswith("rerank-")
        results = body["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -ref[i])
        assert all(abs(x["relevance_score"] - ref[x["index"]]) <= 1e-6 for x in results)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    documents = {x["index"]: x["document"] for x in results}
    assert documents[0] == {"text": DOCUMENTS[0]
                            } and documents[2] == {"multi_modal": DOCUMENTS[2]["content"]}
    top = post(servers["rerank"], "/rerank",
               {"query": query, "documents": DOCUMENTS, "top_n": 1}).json()
    assert [x["index"] for x in top["results"]] == [results[0]["index"]]
    # instruction: the reranker's task line, as LLM.score(instruction=...)
    custom = [
        o.outputs.score
        for o in reranker.score(query, DOCUMENTS[:2], use_tqdm=False, instruction="Judge.")
    ]
    r = post(servers["rerank"], "/rerank",
             {"query": query, "documents": DOCUMENTS[:2], "instruction": "Judge."})
    assert {x["index"]: round(x["relevance_score"], 6) for x in r.json()["results"]} == \
        {i: round(s, 6) for i, s in enumerate(custom)}


def test_video_items(servers, reranker, embedder):
    """A video part of a score item (the reranker) and of embedding messages, as LLM.score /
    LLM.embed read it."""
    clip = encode(drawn_clip(12, 64, 96, seed=7), fps=4)
    video = {"type": "video_url", "video_url": {"url": data_uri(clip, "video/mp4")}}
    document = {"content": [video, {"type": "text", "text": "A square moves."}]}
    r = post(servers["rerank"], "/score",
             {"text_1": "What moves?", "text_2": [document, "Nothing."]})
    assert r.status_code == 200, r.text
    ref = reranker.score("What moves?", [{"video": clip, "text": "A square moves."}, "Nothing."],
                         use_tqdm=False)
    assert all(abs(d["score"] - o.outputs.score) <= 1e-6 for d, o in zip(r.json()["data"], ref))
    assert r.json()["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in ref)
    messages = [{"role": "user", "content": [video, {"type": "text", "text": "A square moves."}]}]
    r = post(servers["embed"], "/v1/embeddings", {"messages": messages})
    assert r.status_code == 200, r.text
    prompt = embedder.engine.chat_prompt([{
        "role": "user", "content": [{"type": "video", "video": clip},
                                    {"type": "text", "text": "A square moves."}]
    }], add_generation_prompt=False)
    assert close(r.json()["data"][0]["embedding"],
                 embedder.llm.embed(prompt, use_tqdm=False)[0].outputs.embedding)


def test_score_on_the_reranker(servers, reranker):
    pairs = (["Is it Paris?", "Do cats purr?"], ["Paris is in France.", "Cats purr."])
    ref = reranker.score(*pairs, use_tqdm=False)
    for names in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2")):
        for path in ("/score", "/v1/score"):
            r = post(servers["rerank"], path,
                     {"model": MODEL, names[0]: pairs[0], names[1]: pairs[1]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
            assert all(d["object"] == "score" and abs(d["score"] - o.outputs.score) <= 1e-6
                       for d, o in zip(body["data"], ref))
            assert body["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in ref)
    one = post(servers["rerank"], "/score",
               {"text_1": "Is it Paris?", "text_2": OFFLINE_DOCUMENTS[0]}).json()
    assert abs(one["data"][0]["score"] - reranker.score("Is it Paris?", OFFLINE_DOCUMENTS[0],
                                                         use_tqdm=False)[0].outputs.score) <= 1e-6


def test_score_and_rerank_on_the_embedder(servers, embedder):
    """An embedding model scores by the cosine of the two items' embeddings, as LLM.score."""
    query, documents = "What is the capital of France?", DOCUMENTS[:2]
    ref = embedder.llm.score(query, documents, use_tqdm=False)
    r = post(servers["embed"], "/score", {"text_1": query, "text_2": documents})
    assert r.status_code == 200, r.text
    assert all(abs(d["score"] - o.outputs.score) <= 1e-6 for d, o in zip(r.json()["data"], ref))
    assert r.json()["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in ref)
    # vLLM's item form, text only
    text_content = {"content": [{"type": "text", "text": documents[1]}]}
    r = post(servers["embed"], "/rerank",
             {"query": query, "documents": [documents[0], text_content]})
    assert r.status_code == 200, r.text
    assert {x["index"]: round(x["relevance_score"], 6) for x in r.json()["results"]} == \
        {i: round(o.outputs.score, 6) for i, o in enumerate(ref)}
    pairwise = embedder.llm.score(documents, [query, query], use_tqdm=False)
    r = post(servers["embed"], "/score", {"queries": documents, "documents": [query, query]})
    assert all(
        abs(d["score"] - o.outputs.score) <= 1e-6 for d, o in zip(r.json()["data"], pairwise))


def test_images_through_the_openai_client_and_the_query_instruction(servers, client, embedder):
    """vLLM's multimodal embeddings through OpenAI's client: `input` as one item's content parts,
    or data-URI strings (each an image), in the Qwen embedder's format with the request's
    instruction: the vectors of Pipeline.embed."""
    parts = [{"type": "image_url", "image_url": {"url": IMAGE}},
             {"type": "text", "text": "A photo."}]
    got = client.embeddings.create(model=MODEL, input=parts, dimensions=16).data
    ref, = embedder.embed(items=[{"image": pil(), "text": "A photo."}], dimensions=16)
    assert len(got) == 1 and close(got[0].embedding, ref)
    other = png_bytes(seed=5)
    got = client.embeddings.create(model=MODEL, input=[IMAGE, "a red house", data_uri(other)],
                                   extra_body={"instruction": "Find the picture."}).data
    refs = embedder.embed(items=[{"image": pil()}, "a red house", {"image": pil(other)}],
                          instruction="Find the picture.")
    assert len(got) == 3 and all(close(g.embedding, r) for g, r in zip(got, refs))
    assert not close(refs[0], embedder.embed(images=[pil()])[0])  # the instruction counts
    assert_idle(servers["embed"])


def test_rerank_and_score_with_images_on_the_embedder_as_pipeline_rerank(servers, embedder):
    """Image documents on an embedder, and the query instruction as a request field: the scores
    and order of Pipeline.rerank; an item against itself scores at most 1 (cosine clamped)."""
    query = "What is the capital of France?"
    ranked = embedder.rerank(query, OFFLINE_DOCUMENTS, instruction="Find the answer.")
    r = post(servers["embed"], "/rerank", {"query": query, "documents": DOCUMENTS,
                                           "instruction": "Find the answer."})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == [x["index"] for x in ranked]
    assert all(abs(x["relevance_score"] - y["score"]) <= 1e-6 for x, y in zip(results, ranked))
    r = post(servers["embed"], "/score", {"text_1": DOCUMENTS[2], "text_2": [DOCUMENTS[2]]})
    assert r.status_code == 200, r.text
    assert 0.999 < r.json()["data"][0]["score"] <= 1.0
    assert_idle(servers["embed"])


def test_cosine_is_clamped():
    from vlinfer.llm import clamp_cosine, cosine
    from vlinfer.outputs import EmbeddingOutput, PoolingRequestOutput
    unit = [0.6, 0.8000000000000002]  # its dot product with itself is 1 + 4e-16
    out = PoolingRequestOutput("a", EmbeddingOutput(unit), [1], True)
    assert sum(x * x for x in unit) > 1.0
    assert cosine(out, out, PoolingParams()) == 1.0 == clamp_cosine(1.0000001)
    assert clamp_cosine(-1.5) == -1.0


# ---- bad requests ----
CORRUPT = data_uri(b"\x89PNG\r\n\x1a\n not really a png")
BAD = [
    # (server, path, body, param, words in the message)
    ("embed", "/v1/embeddings", {"input": ""}, "input", "the prompt is empty"),
    ("embed", "/v1/embeddings", {"input": []}, "input", "input is empty"),
    ("embed", "/v1/embeddings", {"input": ["ok", ""]}, "input.1", "the prompt is empty"),
    ("embed", "/v1/embeddings", {"input": "x", "dimensions": 999}, "dimensions",
     "dimensions=999 is larger than the model's embedding size 128"),
    ("embed", "/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions",
     "dimensions must be a positive int"),
    ("embed", "/v1/embeddings", {"input": "x", "dimensions": "8"}, "dimensions", "valid integer"),
    ("embed", "/v1/embeddings", {"input": 5}, "input", "invalid request: input"),
    ("embed", "/v1/embeddings", {"input": [1, "a"]}, "input.0", "invalid request: input"),
    ("embed", "/v1/embeddings", {"input": [[1, 2],
                                           [-3]]}, "input.1", "out of the vocabulary range"),
    ("embed", "/v1/embeddings", {"input": "x",
                                 "encoding_format": "hex"}, "encoding_format", "encoding_format"),
    ("embed", "/v1/embeddings", {"input": "x", "embed_dtype": "float16"}, "embed_dtype", "float32"),
    ("embed", "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens", "truncate_prompt_tokens must be a positive int or -1"),
    ("embed", "/v1/embeddings", {}, "input", "exactly one of input"),
    ("embed", "/v1/embeddings", {"input": "x",
                                 "messages": [{"role": "user",
                                               "content": "x"}]}, "input", "exactly one of input"),
    ("embed", "/v1/embeddings", {"input": "look <|image_pad|>"}, "input", "special vision token"),
    ("embed", "/v1/embeddings", {"input": ["fine", "x" * 3000 + " y" * 3000]}, "input.1",
     "more than max_model_len"),
    ("embed", "/v1/embeddings", {
        "messages": [{
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": CORRUPT}}]
        }]
    }, "messages.0.content.0.image_url.url", "invalid image"),
    ("embed", "/v1/embeddings", {
        "messages": [{
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
        }]
    }, "messages.0.content.0.image_url.url", "image URLs are disabled"),
    ("embed", "/v1/embeddings", {"messages": []}, "messages", "at least 1"),
    ("embed", "/v1/embeddings", {"input": "x", "mm_processor_kwargs": {"max_pixels": 4096}},
     "mm_processor_kwargs", "applies to messages"),
    ("embed", "/v1/embeddings", {"input": "x", "model": "other"}, "model", "does not exist"),
    ("generate", "/v1/embeddings", {"input": "x"}, "model", "is a generative model"),
    ("rerank", "/v1/embeddings", {"input": "x"}, "model", "is a reranker"),
    ("headless", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model",
     "cannot generate"),
    ("headless", "/v1/completions", {"prompt": "hi"}, "model", "cannot generate"),
    ("generate", "/score", {"text_1": "a", "text_2": "b"}, "model", "is a generative model"),
    ("generate", "/rerank", {"query": "a", "documents": ["b"]}, "model", "is a generative model"),
    ("rerank", "/score", {"query": "a"}, "text_1", "send one pair of fields"),
    ("rerank", "/score", {"text_1": "a", "documents": ["b"]}, "text_1", "send one pair of fields"),
    ("rerank", "/score", {"text_1": "a"}, "text_2", "text_2 is missing"),
    ("rerank", "/score", {"text_1": ["a", "b"],
                          "text_2": ["c", "d",
                                     "e"]}, "text_2", "two lists of one length; got 2 and 3"),
    ("rerank", "/score", {"text_1": "a", "text_2": [1]}, "text_2.0", "invalid request"),
    ("rerank", "/score", {"text_1": "a",
                          "text_2": {"text": "b"}}, "text_2.content", "Field required"),
    ("rerank", "/rerank", {"query": "a", "documents": []}, "documents", "got 1 and 0"),
    ("rerank", "/rerank", {"query": "a", "documents": ["b"],
                           "top_n": -1}, "top_n", "greater than or equal to 0"),
    ("rerank", "/rerank", {"query": ["a"], "documents": ["b"]}, "query", "invalid request"),
    ("rerank", "/rerank", {"documents": ["b"]}, "query", "Field required"),
    ("rerank", "/rerank", {
        "query": "a",
        "documents": ["b", {"content": [{"type": "image_url", "image_url": {"url": CORRUPT}}]}]
    }, "documents.1.content.0.image_url.url", "invalid image"),
    ("rerank", "/rerank", {
        "query": "a", "documents": [{
            "content": [{"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}}]
        }]
    }, "documents.0.content.0.image_url.detail", "detail is not taken"),
    ("rerank", "/rerank", {"query": "a",
                           "documents": [{"content": []}]}, "documents.0.content", "at least 1"),
    ("rerank", "/rerank", {"query": "a <|vision_start|>", "documents": ["b"]}, "documents.0",
     "query and documents.0: text contains the special vision token"),
    ("rerank", "/rerank",
     {"query": "a", "documents": ["b"],
      "mm_processor_kwargs": {"max_pixels": 4096}}, "mm_processor_kwargs", "not taken here"),
    ("rerank", "/rerank", {"query": "a", "documents": ["b"],
                           "use_activation": False}, "use_activation", "not supported"),
    ("rerank", "/rerank", {"query": "a", "documents": ["b"] * 513}, "documents",
     "asks for 513 pairs to score; the limit is 512"),
    ("rerank", "/rerank", {
        "query": "a",
        "documents": [{"content": [{"type": "image_url", "image_url": {"url": IMAGE}}]}] * 17
    }, "documents", "the request has 17 images and videos; the limit is 16 per request"),
    ("embed", "/rerank", {"query": "a", "documents": [{"content": [
        {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]}, "documents.0",
     "give an instruction to embed items in its format"),
    ("embed", "/v1/embeddings", {"input": [[1, 2]], "instruction": "Find."}, "input.0",
     "token ids cannot take the embedder's format"),
    ("embed", "/v1/embeddings", {"input": [{"type": "image_url", "image_url": {"url": CORRUPT}}]},
     "input.content.0.image_url.url", "invalid image"),
    ("embed", "/score", {"text_1": "", "text_2": "b"}, "text_1", "the prompt is empty"),
]


@pytest.mark.parametrize("kind, path, body, param, words", BAD,
                         ids=[f"{b[0]}{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_are_400s_naming_the_problem(servers, kind, path, body, param, words):
    r = post(servers[kind], path, body)
    error = r.json()["error"]
    assert r.status_code == (404 if "does not exist" in words else 400), r.text
    assert words in error["message"] and error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    assert_idle(servers[kind])


def test_malformed_bodies_and_the_guard(servers):
    server = servers["rerank"]
    for path in ("/v1/embeddings", "/score", "/rerank"):
        r = httpx.post(
            server.url + path, content=b"{not json", timeout=30,
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = httpx.post(
            server.url + path, content=b"[]", timeout=30,
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
        r = httpx.post(server.url + path, content=b"{}", timeout=30,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"})
        assert r.status_code == 415
        r = httpx.post(server.url + path, json={"query": "a", "documents": ["b"]}, timeout=30)
        assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
        r = post(server, path, {"input": "x" * MAX_BODY})
        assert r.status_code == 413 and "larger than the limit" in r.json()["error"]["message"]
    assert post(server, "/rerank", {"query": "a", "documents": ["b"]}).status_code == 200


def test_a_bad_request_never_affects_the_others(servers, embedder):
    """Good and bad requests at once from several clients: every good answer is LLM.embed's, every
    bad one a 400, and nothing is left in the engine."""
    server = servers["embed"]
    ref = embedder.llm.embed(TEXTS, use_tqdm=False)
    bad = [{"input": ["fine", "look <|image_pad|>"]}, {"input": "x", "dimensions": 999}, {
        "messages": [{
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": CORRUPT}}]
        }]
    }]
    results, errors = {}, []

    def one(i):
        try:
            if i % 2:
                r = post(server, "/v1/embeddings", bad[i // 2 % len(bad)])
                results[i] = r.status_code == 400
            else:
                r = post(server, "/v1/embeddings", {"input": TEXTS})
                results[i] = r.status_code == 200 and all(
                    close(d["embedding"], o.outputs.embedding)
                    for d, o in zip(r.json()["data"], ref))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and results == {i: True for i in range(12)}, (errors, results)
    assert_idle(server)
    text = httpx.get(server.url + "/metrics").text
    assert 'vlinfer_requests_total{route="/v1/embeddings",status="200"}' in text
    assert 'vlinfer_requests_total{route="/v1/embeddings",status="400"}' in text


def test_generation_still_works_beside_pooling(servers):
    """The embedder's checkpoint has an LM head, so its pooling engine generates too; the generating
    server serves chat as before."""
    for kind in ("embed", "generate"):
        r = post(
            servers[kind], "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert_idle(servers[kind])
