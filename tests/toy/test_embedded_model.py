"""The embedded toy Qwen3-VL (vlinfer/toy/embedded.py, trained by tools/train_embedded.py on
vlinfer/toy/scenes.py): it describes held-out drawn scenes truthfully, its outputs under vlinfer
equal transformers' through batching, chunked prefill and the prefix cache, its training is
reproducible, and the package ships it small."""
import os

import pytest
import torch

from dependencies import REPO, tool_script

from engine_checks import assert_block_pool_empty

from text_checkpoints import hf_qwen3_vl_processor
from vlinfer import LLM, Pipeline, SamplingParams
from vlinfer.toy import embedded, scenes
from vlinfer.loading import resolve_model

IM_END = 151645
# The README's figures (tools/train_embedded.py --evaluate: captions judged on their whole content,
# counts included, scenes.caption_is_right; answers equal to the truth) minus the spread measured
# between sets of 200 scenes (seed 1,000,000 and the two halves of seed 3,000,000's 400: captions
# 91.5-94%, answers 98.95-99.56%), so another CPU's float order cannot fail them.
CAPTION_SPREAD, ANSWER_SPREAD = 0.025, 0.006
HELD_OUT = dict(caption_accuracy=0.94 - CAPTION_SPREAD, answer_accuracy=0.989 - ANSWER_SPREAD)
UNSEEN_SEED = dict(caption_accuracy=0.915 - CAPTION_SPREAD, answer_accuracy=0.993 - ANSWER_SPREAD)


@pytest.fixture(scope="module")
def toy():
    folder = resolve_model("qwen3-vl-toy").path
    return folder, LLM(folder, dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20)


def test_package_ships_the_trained_model_small():
    manifest = embedded.read_manifest()
    weights = os.path.join(embedded.PACKAGE_DIR, embedded.WEIGHTS)
    assert embedded.sha256(weights) == manifest["sha256"]
    assert os.path.getsize(weights) < 10 * 2 ** 20  # the budget for the package's growth
    assert manifest["shape"] == {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in embedded.SHAPE.items()
    }
    # Three stages, each from the weights the one before made (tools/train_embedded.py
    # train_shipped): the manifest's training is the last, its "init" the stage before.
    stage, hashes = manifest, []
    for recipe in reversed(embedded.STAGES):
        assert {k: stage["training"][k] for k in recipe} == recipe, f"not the recorded {recipe}"
        hashes.append(stage["sha256"])
        stage = stage["training"].get("init")
    assert stage is None and len(set(hashes)) == len(embedded.STAGES)


def test_toy_describes_held_out_scenes(toy):
    """The 200 held-out scenes (a seed training never used), scored as the issue asks and as the
    README states."""
    scores = tool_script("train_embedded").evaluate(toy[1], seed=embedded.EVAL_SEED, count=200)
    assert all(scores[k] >= bar for k, bar in HELD_OUT.items()), \
        {**scores, "failures": scores["failures"][:8]}
    assert_block_pool_empty(toy[1])


@pytest.mark.slow  # 400 scenes, ~2,700 requests: ~45 s on 2 cores
def test_toy_describes_scenes_of_a_seed_never_used(toy):
    """The README's second figure: 400 scenes of seed 3,000,000, used by no training or test."""
    scores = tool_script("train_embedded").evaluate(toy[1], seed=3_000_000, count=400)
    assert all(scores[k] >= bar for k, bar in UNSEEN_SEED.items()), \
        {**scores, "failures": scores["failures"][:8]}


def test_example_image_gets_a_true_caption(toy):
    out = toy[1].chat([{
        "role": "user", "content": [{
            "type": "image", "image": os.path.join(REPO, "examples", "images", "red_house.png")
        }, {"type": "text", "text": "Describe this image."}]
    }], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0].text
    assert scenes.parse_caption(out)["objects"] == {("red", "house"): 1,
                                                    ("yellow", "circle"): 1}, out


def requests():
    """Single-turn chats about held-out scenes: captions, questions, two images in one turn, a
    follow-up turn."""
    items = scenes.generate(embedded.EVAL_SEED + 1, 3)
    convs = []
    for scene, image, qa in items:
        convs.append([{
            "role": "user", "content": [{"type": "image", "image": image},
                                        {"type": "text", "text": "Describe this image."}]
        }])
        convs.append([{"role": "user", "content": [{"type": "image", "image": image},
                                                   {"type": "text", "text": qa[0][0]}]}])
    convs.append([{
        "role": "user", "content": [{"type": "image",
                                     "image": items[0][1]}, {"type": "image", "image": items[1][1]},
                                    {"type": "text", "text": "What is in this picture?"}]
    }])
    convs.append([{
        "role": "user", "content": [{"type": "image", "image": items[2][1]},
                                    {"type": "text", "text": "Describe this image."}]
    }, {"role": "assistant", "content": scenes.caption(items[2][0])
        }, {"role": "user", "content": [{"type": "text", "text": "How many objects are there?"}]}])
    return convs


def hf_answer(model, llm, conversation) -> list[int]:
    """transformers' greedy answer (float32), its inputs made by its own Qwen3VLProcessor, up to
    <|im_end|>."""
    text = llm.tokenizer.apply_chat_template([{
        "role": m["role"], "content": m["content"]
        if isinstance(m["content"], str) else [{"type": p["type"]} if p["type"] == "image" else p
                                               for p in m["content"]]
    } for m in conversation], tokenize=False, add_generation_prompt=True,
                                             chat_template=llm.engine.input_processor.chat_template)
    images = [
        p["image"] for m in conversation if not isinstance(m["content"], str) for p in m["content"]
        if p["type"] == "image"
    ]
    out = hf_qwen3_vl_processor(llm.engine.source.folder)(text=[text], images=images,
                                                          return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(out["input_ids"], attention_mask=out["attention_mask"],
                             pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                             mm_token_type_ids=out["mm_token_type_ids"], max_new_tokens=40,
                             do_sample=False, eos_token_id=IM_END, pad_token_id=IM_END)
    answer = ids[0, out["input_ids"].shape[1]:].tolist()
    return answer[:answer.index(IM_END)] if IM_END in answer else answer


def ours(outputs) -> list[list[int]]:
    return [[t for t in o.outputs[0].token_ids if t != IM_END] for o in outputs]


def test_toy_matches_transformers_through_batching_chunking_and_prefix_cache(toy):
    from transformers import Qwen3VLForConditionalGeneration
    folder, _ = toy
    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    greedy = SamplingParams(temperature=0, max_tokens=40)
    llm = LLM(folder, dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20)
    convs = requests()
    references = [hf_answer(model, llm, c) for c in convs]
    assert all(references) and len({tuple(r) for r in references}) > 3  # real, different answers
    batched = llm.chat(convs, greedy, use_tqdm=False)  # one batch
    assert ours(batched) == references
    # the same prompts again: served from the prefix cache
    again = llm.chat(convs, greedy, use_tqdm=False)
    assert ours(again) == references and all(o.num_cached_tokens > 0 for o in again)
    assert_block_pool_empty(llm)
    chunked = LLM(folder, dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20,
                  max_num_batched_tokens=16)
    assert ours(chunked.chat(convs, greedy, use_tqdm=False)) == references
    assert_block_pool_empty(chunked)


def test_short_training_is_reproducible(tmp_path):
    """A few steps of the shipped recipe twice with one seed give one hash; another seed another."""
    train_embedded = tool_script("train_embedded")
    kw = dict(steps=2, batch_size=1, threads=1, lr=2e-3, max_turns=2, shape=dict(embedded.SHAPE),
              log_every=100)
    first = train_embedded.train(str(tmp_path / "a"), seed=0, **kw)
    second = train_embedded.train(str(tmp_path / "b"), seed=0, **kw)
    other = train_embedded.train(str(tmp_path / "c"), seed=1, **kw)
    assert first["sha256"] == second["sha256"] != other["sha256"]
    # A second stage from the first run's weights: reproducible too, and a change of the weights it
    # started from.
    finer = [
        train_embedded.train(str(tmp_path / name), seed=1, init=str(tmp_path / "a"), **kw)["sha256"]
        for name in ("d", "e")
    ]
    assert finer[0] == finer[1] not in (first["sha256"], other["sha256"])


def test_toy_reranker_finds_kinds_of_objects_in_held_out_scenes():
    """The embedded toy as a reranker (its "Yes" against its "No" to "Is there a red house?"): six
    kinds of object, each query ranking 60 held-out scenes; the README's figure is the slow test's,
    every kind over 200."""
    pipe = Pipeline("qwen3-vl-toy-reranker", dtype="float32", max_model_len=1024)
    assert pipe.engine.pooling.task == "classify"
    kinds = [("red", "house"), ("blue", "circle"), ("green", "star"), ("yellow", "triangle"),
             ("purple", "square"), ("red", "star")]
    scores = tool_script("train_embedded").evaluate_retrieval(pipe, count=60, kinds=kinds)
    assert scores["queries"] >= 5 and scores["recall_at_5"] >= 0.9 and scores[
        "precision_at_5"] >= 0.8, scores
    assert_block_pool_empty(pipe.llm)


@pytest.mark.slow  # every kind of object (30) over the 200 held-out scenes: ~30 s on 2 cores
def test_toy_reranker_recall_on_all_held_out_scenes():
    pipe = Pipeline("qwen3-vl-toy-reranker", dtype="float32")
    scores = tool_script("train_embedded").evaluate_retrieval(pipe, count=200)
    assert scores["recall_at_5"] >= 0.9, scores
