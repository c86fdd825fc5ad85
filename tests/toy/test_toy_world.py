"""The toys' world is stated where a newcomer meets them (the README, each toy's notice) as
scenes.py draws it, a picture outside it ends within the world's longest answer, and the chat
example asks what the world can answer."""
import os
import re
import subprocess
import sys

import pytest
from PIL import Image

from dependencies import REPO
from vlinfer import Pipeline
from vlinfer.config import ANSWER_MAX_TOKENS
from vlinfer.loading.sources import EMBEDDED_MODELS, TOY_RUNS
from vlinfer.toy import scenes


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_world_is_stated_in_the_readme_and_every_toy_notice():
    world = scenes.world()
    for name in TOY_RUNS:
        assert world in EMBEDDED_MODELS[name], name
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = _flat(f.read())
    assert world in readme
    assert f"stops at {scenes.MAX_ANSWER_TOKENS} tokens" in readme


def test_the_world_is_what_the_generator_draws():
    """Canvas sizes, backgrounds, counts and object sizes of 400 generated scenes lie inside what
    world() says, and reach its ends."""
    import random
    rng = random.Random(0)
    drawn = [scenes.random_scene(rng) for _ in range(400)]
    across = [2 * o.half for s in drawn for o in s.objects]
    low, high = map(int, re.search(r"(\d+)-(\d+) pixels across", scenes.world()).groups())
    assert low <= min(across) and max(across) <= high
    assert max(across) - min(across) > (high - low) * 0.8
    assert {(s.width, s.height) for s in drawn} == set(scenes.SIZES)
    assert {len(s.objects) for s in drawn} == set(range(1, scenes.MAX_OBJECTS + 1))


def test_the_training_augmentation_stays_inside_the_world():
    """random_scene(anywhere=True), the training's augmentation: every object inside world()'s size
    range and its own grid cell, reaching sizes the plain draw never puts on the 320x240 canvas."""
    import random
    rng = random.Random(0)
    drawn = [scenes.random_scene(rng, anywhere=True) for _ in range(400)]
    low, high = scenes.across()
    wide = 0.0
    for s in drawn:
        cell_w, cell_h = s.width / scenes.GRID, s.height / scenes.GRID
        for o in s.objects:
            assert low <= 2 * o.half <= high
            col, row = (o.cx - o.half) // cell_w, (o.cy - o.half) // cell_h
            assert (o.cx + o.half) <= (col + 1) * cell_w and (o.cy + o.half) <= (row + 1) * cell_h
            if (s.width, s.height) == (320, 240):
                wide = max(wide, 2 * o.half)
    assert wide > 2 * 80 * scenes.HALF_SHARE[1] + 5  # plain: at most 0.44 of the 80-pixel cell


@pytest.fixture(scope="module")
def toy():
    return Pipeline("qwen3-vl-toy", max_model_len=1024, kv_cache_bytes=16 << 20)


def test_a_picture_outside_the_world_ends_within_the_worlds_longest_answer(toy):
    """A 1x1 picture made the toy loop to Pipeline's 512 tokens; on the toys the default is the
    world's longest answer. The real models keep room for a full answer."""
    assert toy.default_max_tokens == scenes.MAX_ANSWER_TOKENS < ANSWER_MAX_TOKENS
    for picture in (Image.new("RGB", (1, 1), "white"), Image.new("RGB", (640, 480), "white")):
        answer = toy(picture, "Describe this image.", temperature=0)
        tokens = toy.engine.tokenizer.encode(answer, add_special_tokens=False)
        assert len(tokens) <= scenes.MAX_ANSWER_TOKENS, answer
    # the world's longest caption fits, whole
    longest = scenes.caption(scenes.Scene(320, 240, "white", tuple(
        scenes.SceneObject("triangle", "purple", 40 + 100 * i, 120, 30) for i in range(3))))
    assert len(toy.engine.tokenizer.encode(longest)) < scenes.MAX_ANSWER_TOKENS


def test_chat_with_images_asks_inside_the_world():
    """examples/chat_with_images.py: one picture per conversation, questions the world answers, and
    the toy's answers true of examples/images (red_house.png: a red house and a yellow circle on
    white; sunset.png: an orange circle and two purple triangles on black)."""
    run = subprocess.run([sys.executable, os.path.join(REPO, "examples", "chat_with_images.py")],
                         capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-2000:]
    answers = re.findall(r"^assistant: '(.*)'$", run.stdout, re.M)
    assert answers[:3] == ["Red.", "One.", "White."], run.stdout
    assert answers[3] == "An orange circle and two purple triangles on a black background.", \
        run.stdout
    assert answers[4] == "Two.", run.stdout
