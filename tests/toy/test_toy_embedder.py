"""The embedded toy embedder (`qwen3-vl-toy-embedding`, tools/train_toy_embedder.py): the package
ships the tensors it changes beside the toy they belong to, the built checkpoint opens as an
embedder without an LM head, its vectors equal transformers' Qwen embedder path, it finds the drawn
world's objects in held-out scenes by cosine alone, the offline default embedder is it, and its
training is reproducible."""
import json
import logging
import os
import shutil

import pytest
import torch

from dependencies import tool_script

from engine_checks import assert_block_pool_empty
from vlinfer import Pipeline
from vlinfer.loading import resolve_model
from vlinfer.toy import embedded, scenes

BAR = 0.9  # recall@5: the bar for the toy world's retrieval


@pytest.fixture(scope="module")
def embedder():
    return Pipeline("qwen3-vl-toy-embedding", dtype="float32", max_model_len=1024)


def test_package_ships_the_embedder_small_and_for_this_toy():
    manifest = embedded.read_embedder_manifest()
    weights = os.path.join(embedded.PACKAGE_DIR, embedded.EMBEDDER_WEIGHTS)
    assert embedded.sha256(weights) == manifest["sha256"]
    assert manifest["toy_sha256"] == embedded.read_manifest(
    )["sha256"], "trained on another toy than the shipped one"
    assert os.path.getsize(weights) < 4 * 2 ** 20
    assert {k: manifest["training"][k]
            for k in embedded.EMBEDDER_TRAINING} == embedded.EMBEDDER_TRAINING


def test_embedder_checkpoint_refuses_a_stale_or_damaged_embedder(tmp_path):
    stale = tmp_path / "stale"
    shutil.copytree(embedded.PACKAGE_DIR, stale)
    manifest = json.loads((stale / embedded.EMBEDDER_MANIFEST).read_text())
    (stale / embedded.EMBEDDER_MANIFEST).write_text(json.dumps(dict(manifest, toy_sha256="0" * 64)))
    with pytest.raises(ValueError, match="trained on toy 000000000000.*retrain it"):
        embedded.build_embedder_checkpoint(embedded.PACKAGE_DIR, str(stale), str(tmp_path / "a"))
    damaged = tmp_path / "damaged"
    shutil.copytree(embedded.PACKAGE_DIR, damaged)
    with open(damaged / embedded.EMBEDDER_WEIGHTS, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\0" * 8)
    with pytest.raises(ValueError, match=f"{embedded.EMBEDDER_WEIGHTS} does not match the sha256"):
        embedded.build_embedder_checkpoint(embedded.PACKAGE_DIR, str(damaged), str(tmp_path / "b"))


def test_embedder_opens_as_a_pooling_model_and_matches_transformers(embedder):
    """The built checkpoint has no LM head (runner="auto" would pick pooling), and our vectors equal
    the Qwen embedder's path in transformers (Qwen3VLModel, the last token, normalized) on texts and
    pictures."""
    from safetensors import safe_open
    from transformers import Qwen3VLModel
    folder = embedder.engine.source.path
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert embedder.engine.pooling.task == "embed" \
        and embedder.engine.model_runner.model.lm_head is None
    trainer = tool_script("train_toy_embedder")
    tokenizer, template = tool_script("train_embedded").load_tokenizer_and_template()
    batcher = trainer.EmbedderBatcher(tokenizer, template, None)
    model = Qwen3VLModel.from_pretrained(folder, dtype=torch.float32).eval()
    texts, images = ["a red house", "green star"
                     ], [image for _, image, _ in scenes.generate(embedded.EVAL_SEED, 3)]
    with torch.no_grad():
        reference = torch.cat([trainer.pooled(model, batcher(texts=texts)),
                               trainer.pooled(model, batcher(images=images))])
    ours = torch.tensor(embedder.embed(texts=texts) + embedder.embed(images=images))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    assert_block_pool_empty(embedder.llm)


def test_toy_embedder_finds_kinds_of_objects_in_held_out_scenes(embedder):
    """Cosine alone (Pipeline.rerank on an embedder): six kinds of object, each query ranking 60
    held-out scenes; the README's figure is the slow test's, every kind over 200."""
    kinds = [("red", "house"), ("blue", "circle"), ("green", "star"), ("yellow", "triangle"),
             ("purple", "square"), ("red", "star")]
    scores = tool_script("train_embedded").evaluate_retrieval(embedder, count=60, kinds=kinds)
    assert scores["queries"] >= 5 and scores["recall_at_5"] >= BAR and scores[
        "precision_at_5"] >= 0.8, scores


@pytest.mark.slow  # every kind of object (30) over the 200 held-out scenes
def test_toy_embedder_recall_on_all_held_out_scenes(embedder):
    scores = tool_script("train_embedded").evaluate_retrieval(embedder, count=200)
    assert scores["recall_at_5"] >= BAR, scores


def test_offline_default_embedder_is_the_trained_toy(caplog, monkeypatch, tmp_path):
    """`qwen3-vl-embedding` without its weights on this machine (an empty Hugging Face cache,
    whatever this machine holds) falls back to the toy embedder, loudly, naming the real embedder to
    fetch."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        source = resolve_model("qwen3-vl-embedding")
    assert source.embedded and source.runner == "pooling"
    assert source.path == resolve_model("qwen3-vl-toy-embedding").path
    assert "Qwen3-VL-Embedding" in source.about
    assert any("TOY" in r.getMessage() and
               "huggingface-cli download Qwen/Qwen3-VL-Embedding-2B" in r.getMessage()
               for r in caplog.records if r.levelno >= logging.WARNING)


def test_short_embedder_training_is_reproducible(tmp_path):
    trainer = tool_script("train_toy_embedder")
    kw = dict(steps=2, batch_size=3, threads=1, lr=2e-3, temperature=0.05, log_every=100)
    first = trainer.train(str(tmp_path / "a"), seed=0, **kw)
    again = trainer.train(str(tmp_path / "b"), seed=0, **kw)
    other = trainer.train(str(tmp_path / "c"), seed=1, **kw)
    assert first["sha256"] == again["sha256"] != other["sha256"]
    assert first["toy_sha256"] == embedded.read_manifest()["sha256"]
