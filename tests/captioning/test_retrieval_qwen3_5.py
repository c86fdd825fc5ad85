"""Embeddings and reranker scores on a Qwen3.5 checkpoint (the hybrid decoder with its vision
tower) through the pooling runner, pooled as the Qwen3-VL-Embedding code pools them (the last
token's final hidden state, normalized; a reranker's sigmoid of the "yes" minus "no" LM-head rows
at the last token), against transformers' Qwen3_5Model on the same weights, float32: text, image
and mixed items alone and batched, and reranker scores. A pooling request is a prefill: each
sequence's linear layers run from zeroed state slots, which it frees when it finishes."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checks import assert_block_pool_empty
from vlinfer import Pipeline
from vlinfer.toy.tiny_checkpoints import (QWEN3_VL_SPECIAL, _rescale,
                                          write_qwen3_vl_processor_files)
from qwen3_5_vl_cases import TEXT, VISION
from retrieval_cases import IMG_A, IMG_B, IMG_C, RERANKER, VIDEO_CONFIG, hf_embedding, hf_score

TOL = 1e-5
ITEMS = {"text": {"text": "A red house beside two blue stars."}, "image": {"image": IMG_A},
         "mixed": {"text": "Which picture is this?", "image": [IMG_B, IMG_C]}}
OPTIONS = dict(dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=2048)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(embedder folder without lm_head.weight, whole checkpoint folder, transformers model)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    config = Qwen3_5Config(vision_config=VISION, text_config=dict(TEXT), tie_word_embeddings=False,
                           architectures=["Qwen3_5ForConditionalGeneration"], **QWEN3_VL_SPECIAL)
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5ForConditionalGeneration(config).eval()
    _rescale(model, torch.Generator().manual_seed(6))
    whole = str(tmp_path_factory.mktemp("qwen3_5-whole"))
    model.save_pretrained(whole, safe_serialization=True)
    write_qwen3_vl_processor_files(whole)
    with open(f"{whole}/video_preprocessor_config.json", "w") as f:
        json.dump(VIDEO_CONFIG, f)
    embedder = str(tmp_path_factory.mktemp("qwen3_5-embedder"))
    shutil.copytree(whole, embedder, dirs_exist_ok=True)
    tensors = load_file(f"{embedder}/model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, f"{embedder}/model.safetensors", metadata={"format": "pt"})
    return embedder, whole, model


def relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def test_embeddings_match_transformers_alone_and_batched(checkpoints):
    embedder, _, model = checkpoints
    pipe = Pipeline(embedder, **OPTIONS)
    engine = pipe.engine
    assert engine.pooling.task == "embed" and engine.model_runner.model.lm_head is None
    assert engine.resolved.num_state_slots > 0
    refs = {name: hf_embedding(pipe.llm, model, item) for name, item in ITEMS.items()}
    alone = {name: torch.tensor(pipe.embed(items=[item])[0]) for name, item in ITEMS.items()}
    batched = pipe.embed(items=list(ITEMS.values()))
    for (name, ref), vector in zip(refs.items(), batched):
        assert relative(alone[name], ref) < TOL, name
        assert relative(torch.tensor(vector), ref) < TOL, name
    assert relative(refs["text"], refs["image"]) > 1e-2  # the items differ
    assert_block_pool_empty(pipe.llm)
    bm = engine.block_manager
    assert bm.num_free_slots == bm.num_state_slots


def test_reranker_scores_match_transformers(checkpoints):
    _, whole, model = checkpoints
    overrides = {k: v for k, v in RERANKER.items() if k != "architectures"}
    pipe = Pipeline(whole, runner="pooling", hf_overrides=overrides, **OPTIONS)
    assert pipe.engine.pooling.task == "classify"
    query = {"text": "a red house"}
    documents = [{"text": "A red house on grass."}, {"image": IMG_A},
                 {"text": "look", "image": IMG_B}]
    instruction = "Retrieve images or text relevant to the user's query."
    outs = pipe.llm.score(query, documents, use_tqdm=False, instruction=instruction)
    refs = [hf_score(pipe.llm, model, query, d, instruction) for d in documents]
    assert [abs(o.outputs.score - r) < TOL for o, r in zip(outs, refs)] == [True] * len(refs)
    assert max(refs) - min(refs) > 1e-4  # the documents score apart
    assert_block_pool_empty(pipe.llm)
