"""Embeddings and reranker scores against transformers, pooled as the Qwen3-VL-Embedding code pools
them (float32, 1e-5): text, image, video and mixed items; alone, batched, mixed with generation,
chunked, from the prefix cache; and bad requests answered one by one. docs/retrieval.md states the
facts these tests hold the engine to."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checks import assert_block_pool_empty
from videos import drawn_clip
from vlinfer import LLM, Pipeline, PoolingParams, SamplingParams
from vlinfer.outputs import RequestError
from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
from retrieval_cases import (IMG_A, IMG_B, IMG_C, RERANKER, VIDEO_CONFIG, hf_embedding,
                             hf_last_hidden, hf_score, qwen_parts)

TOL = 1e-5
CLIP = (drawn_clip(8, 64, 96, seed=4), {"fps": 4.0})
ITEMS = {
    "text": {"text": "A red house beside two blue stars."},
    "image": {"image": IMG_A},
    "video": {"video": CLIP},
    "mixed": {"text": "Which picture is this?", "image": [IMG_B, IMG_C]},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(embedder folder, reranker folder, transformers model): the embedder is the generative
    checkpoint saved as Qwen3VLForEmbedding saves it, without lm_head.weight; the reranker is the
    whole checkpoint."""
    from transformers import Qwen3VLForConditionalGeneration
    reranker = build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("reranker")), seed=0,
                                   tie_word_embeddings=False)
    with open(f"{reranker}/video_preprocessor_config.json", "w") as f:
        json.dump(VIDEO_CONFIG, f)
    embedder = str(tmp_path_factory.mktemp("embedder"))
    import shutil
    shutil.copytree(reranker, embedder, dirs_exist_ok=True)
    tensors = load_file(f"{embedder}/model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, f"{embedder}/model.safetensors", metadata={"format": "pt"})
    model = Qwen3VLForConditionalGeneration.from_pretrained(reranker, dtype=torch.float32).eval()
    return embedder, reranker, model


@pytest.fixture(scope="module")
def embedder(checkpoints):
    return Pipeline(checkpoints[0], dtype="float32", kv_cache_bytes=32 * 2**20, max_model_len=2048)


@pytest.fixture(scope="module")
def references(checkpoints, embedder):
    return {name: hf_embedding(embedder.llm, checkpoints[2], item) for name, item in ITEMS.items()}


def test_embedder_checkpoint_opens_as_pooling_without_an_lm_head(embedder):
    engine = embedder.engine
    assert engine.pooling.task == "embed" and engine.model_runner.model.lm_head is None
    assert not engine.can_generate
    with pytest.raises(RequestError, match="cannot generate"):
        embedder.llm.generate("hello", use_tqdm=False)


def test_vision_towers_keep_plain_float32_weights(embedder, reranker):
    """On the CPU a float32 linear that only sees prefill-sized row counts runs F.linear on its
    plain weight (MKL's sgemm) instead of a packed layout made for decode's few rows: the vision
    tower's, in an embedder as in a model that generates; the decoder's stay packed (an embedder's
    too: a query is a few rows)."""
    from vlinfer.layers.linear import LinearBase
    for pipe in (embedder, reranker):
        assert pipe.engine.model_runner.ctx.ops.name == "cpu-compiled"
        model = pipe.engine.model_runner.model
        vision = [m for m in model.model.visual.modules() if isinstance(m, LinearBase)]
        decoder = [m for m in model.model.language_model.modules() if isinstance(m, LinearBase)]
        assert vision and all(not m.weight.is_mkldnn and m.weight.dim() == 2 for m in vision)
        assert decoder and all(m.weight.is_mkldnn or m.weight.dim() > 2 for m in decoder)


@pytest.mark.parametrize("name", list(ITEMS))
def test_each_item_alone_matches_transformers(embedder, references, name):
    vector, = embedder.embed(items=[ITEMS[name]])
    assert torch.allclose(torch.tensor(vector), references[name], atol=TOL, rtol=0)
    assert_block_pool_empty(embedder.llm)  # a pooling request frees its blocks when it is pooled


def test_batched_items_match_transformers(embedder, references):
    vectors = embedder.embed(items=list(ITEMS.values()))
    for name, vector in zip(ITEMS, vectors):
        assert torch.allclose(torch.tensor(vector), references[name], atol=TOL, rtol=0), name


def test_instruction_matryoshka_and_unnormalized(checkpoints, embedder):
    item = ITEMS["mixed"]
    instruction = "Find pictures like this"  # gets its '.', as the Qwen code adds one
    ref = hf_last_hidden(embedder.llm, checkpoints[2], [
        {"role": "system", "content": [{"type": "text", "text": instruction + "."}]},
        {"role": "user", "content": qwen_parts(item)}])
    full, = embedder.embed(items=[item], instruction=instruction)
    short, = embedder.embed(items=[item], instruction=instruction, dimensions=32)
    assert torch.allclose(torch.tensor(full), torch.nn.functional.normalize(ref, dim=-1), atol=TOL,
                          rtol=0)
    assert len(short) == 32
    assert torch.allclose(torch.tensor(short), torch.nn.functional.normalize(ref[:32], dim=-1),
                          atol=TOL, rtol=0)
    prompt = embedder.engine.chat_prompt([{"role": "user", "content": "raw"}])
    raw, = embedder.llm.embed([prompt], PoolingParams(normalize=False), use_tqdm=False)
    unit, = embedder.llm.embed([prompt], use_tqdm=False)
    raw = torch.tensor(raw.outputs.embedding)
    assert raw.norm() > 1.5 and torch.allclose(raw / raw.norm(), torch.tensor(
        unit.outputs.embedding), atol=TOL)


def test_chunked_prefill_prefix_cache_and_generation_in_one_batch(checkpoints, references):
    """A pooling engine whose checkpoint has an LM head (the reranker folder run as an embedder)
    takes generation requests too: both kinds in the same steps, prompts prefilled in 32-token
    chunks, a repeated item from the prefix cache. The vectors stay transformers' and the greedy
    tokens stay the ones the engine gives alone."""
    folder = checkpoints[1]
    options = dict(dtype="float32", kv_cache_bytes=32 * 2**20, max_model_len=2048,
                   max_num_batched_tokens=32, runner="pooling")
    pipe = Pipeline(folder, **options)
    engine = pipe.engine
    assert engine.pooling.task == "embed" and engine.can_generate
    from vlinfer.inputs.retrieval import embedding_messages, mm_processor_kwargs
    conversations = {name: embedding_messages(item) for name, item in ITEMS.items()}
    prompts = {name: engine.chat_prompt(messages, mm_processor_kwargs=mm_processor_kwargs(messages))
               for name, messages in conversations.items()}
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = pipe.llm.generate("Tell me about houses.", greedy,
                              use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("Tell me about houses.", greedy, request_id="gen")
    for name, prompt in prompts.items():
        engine.add_request(prompt, PoolingParams(task="embed"), request_id=name)
    engine.add_request(prompts["mixed"], PoolingParams(task="embed"), request_id="again")
    vectors, tokens, shared_steps = {}, None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        shared_steps += len(engine.scheduler.running) > 1 and "gen" in {
            s.request_id
            for s in engine.scheduler.running
        }
        for out in outs:
            if out.request_id == "gen" and out.finished:
                tokens = out.outputs[0].token_ids
            elif out.request_id != "gen":
                vectors[out.request_id] = out
    assert tokens == alone
    assert shared_steps > 0
    for name in ITEMS:
        assert torch.allclose(torch.tensor(vectors[name].outputs.embedding), references[name],
                              atol=TOL, rtol=0)
    again = vectors["again"]
    assert again.num_cached_tokens > 0
    assert torch.allclose(torch.tensor(again.outputs.embedding), references["mixed"], atol=TOL,
                          rtol=0)


@pytest.fixture(scope="module")
def reranker(checkpoints):
    return Pipeline(checkpoints[1], dtype="float32", kv_cache_bytes=32 * 2**20, max_model_len=2048,
                    runner="pooling", hf_overrides=RERANKER)


def test_reranker_scores_match_transformers(checkpoints, reranker):
    query = {"text": "a red house"}
    documents = [{"text": "A red house on grass."}, {"image": IMG_A},
                 {"text": "look", "image": IMG_B}, {"video": CLIP}, "plain string document"]
    instruction = "Retrieve images or text relevant to the user's query."
    assert reranker.engine.pooling.task == "classify"
    outs = reranker.llm.score(query, documents, use_tqdm=False, instruction=instruction)
    refs = [
        hf_score(reranker.llm, checkpoints[2], query, d if isinstance(d, dict) else {"text": d},
                 instruction) for d in documents
    ]
    assert [abs(o.outputs.score - r) < TOL for o, r in zip(outs, refs)] == [True] * len(documents)
    ranked = reranker.rerank(query, documents, instruction=instruction, top_k=3)
    assert [r["index"] for r in ranked] == sorted(range(len(refs)), key=lambda i: -refs[i])[:3]
    probs = reranker.llm.classify(
        [reranker.engine.chat_prompt([{"role": "user", "content": "yes?"}])],
        use_tqdm=False)[0].outputs.probs
    assert len(probs) == 1 and 0 < probs[0] < 1


def test_embedder_scores_are_cosines(embedder):
    outs = embedder.llm.score("a red house", ["a red house", "two blue stars"], use_tqdm=False)
    vectors = embedder.llm.embed(["a red house", "two blue stars"], use_tqdm=False)
    same = sum(a * b for a, b in zip(vectors[0].outputs.embedding, vectors[0].outputs.embedding))
    cross = sum(a * b for a, b in zip(vectors[0].outputs.embedding, vectors[1].outputs.embedding))
    assert outs[0].outputs.score == pytest.approx(same, abs=1e-6) and abs(same - 1) < 1e-5
    assert outs[1].outputs.score == pytest.approx(cross, abs=1e-6)


def test_bad_requests_are_answered_one_by_one(checkpoints, embedder):
    good = "a red house"
    corrupt = {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>",
        "multi_modal_data": {"image": b"not a png"}
    }
    with pytest.raises(RequestError) as e:
        embedder.llm.embed([good, "", corrupt, good], use_tqdm=False)
    outs = e.value.outputs
    assert outs[0].error is None and outs[3].error is None
    assert outs[0].outputs.embedding == outs[3].outputs.embedding
    assert "empty" in outs[1].error and "image" in outs[2].error
    # wrong for every prompt alike: one ValueError for the call, not a RequestError per prompt
    for call, says in ((lambda: embedder.llm.embed([good, good], PoolingParams(dimensions=129),
                                                   use_tqdm=False),
                        "larger than the model's embedding size 128"),
                       (lambda: embedder.llm.classify([good, good], use_tqdm=False),
                        "no classifier")):
        with pytest.raises(ValueError, match=says) as e:
            call()
        assert not isinstance(e.value, RequestError) and str(e.value).count(says) == 1
    with pytest.raises(ValueError, match="positive int"):
        PoolingParams(dimensions=0)
    assert_block_pool_empty(embedder.llm)
    generative = LLM(checkpoints[1], dtype="float32", kv_cache_bytes=8 * 2 ** 20, max_model_len=256)
    assert generative.engine.pooling is None
    with pytest.raises(RequestError, match="runs the generate runner"):
        generative.embed([good], use_tqdm=False)
    with pytest.raises(ValueError, match="runner"):
        LLM(checkpoints[1], runner="pool")


def test_unsupported_classifier_overrides_fail_at_load(checkpoints):
    with pytest.raises(ValueError, match="classifier_from_token"):
        LLM(checkpoints[1], runner="pooling",
            hf_overrides={**RERANKER, "classifier_from_token": ["no"]})
    with pytest.raises(ValueError, match="not tokens of the model's vocabulary"):
        LLM(
            checkpoints[1], runner="pooling", kv_cache_bytes=8 * 2**20, max_model_len=256,
            hf_overrides={
                **RERANKER, "classifier_from_token": ["no", "definitely-not-a-token-xyz"]
            })
    with pytest.raises(ValueError, match="classification model: run it with runner='pooling'"):
        LLM(checkpoints[1], runner="generate", hf_overrides=RERANKER)


def test_pooled_rows_skip_the_lm_head(checkpoints, embedder, monkeypatch):
    """No LM head for an embedding (the embedder has none); the reranker computes its two rows only.
    """
    calls = []
    reranker_llm = LLM(checkpoints[1], dtype="float32", kv_cache_bytes=8 * 2**20, max_model_len=512,
                       runner="pooling", hf_overrides=RERANKER)
    model = reranker_llm.engine.model_runner.model
    monkeypatch.setattr(model, "compute_logits",
                        lambda h: calls.append(h.shape) or torch.zeros(h.shape[0], 1))
    reranker_llm.score("q", ["d1", "d2"], use_tqdm=False)
    assert calls == [] and model.classifier.weight.shape == (2, 128)
    np.testing.assert_array_equal(
        model.classifier.weight.numpy(), checkpoints[2].lm_head.weight[[
            reranker_llm.tokenizer.get_vocab()[t] for t in ("no", "yes")
        ]].detach().numpy())


@pytest.mark.slow  # two processes per engine: `make test-full` and CI run it
def test_tensor_parallel_vectors_and_scores_equal_one_rank(checkpoints, references):
    """TP=2: the hidden states are whole on rank 0 after the last all-reduce, so the pooled rows
    (and the reranker's replicated label rows) give transformers' vectors and TP=1's scores."""
    options = dict(dtype="float32", kv_cache_bytes=32 * 2**20, max_model_len=2048,
                   tensor_parallel_size=2)
    pipe = Pipeline(checkpoints[0], **options)
    try:
        vectors = pipe.embed(items=list(ITEMS.values()))
    finally:
        pipe.llm.close()
    for name, vector in zip(ITEMS, vectors):
        assert torch.allclose(torch.tensor(vector), references[name], atol=TOL, rtol=0), name
    documents = ["A red house on grass.", {"image": IMG_A}, {"video": CLIP}]
    one = LLM(checkpoints[1], dtype="float32", kv_cache_bytes=32 * 2**20, max_model_len=2048,
              runner="pooling", hf_overrides=RERANKER).score("a red house", documents,
                                                             use_tqdm=False)
    with LLM(checkpoints[1], runner="pooling", hf_overrides=RERANKER, **options) as llm:
        two = llm.score("a red house", documents, use_tqdm=False)
    assert [abs(a.outputs.score - b.outputs.score) < TOL
            for a, b in zip(one, two)] == [True] * len(documents)
