"""Pictures of the toy's world drawn by another hand (tools/hand_drawn.py: its own PIL code, never
scenes.draw): the set lies inside scenes.world() and shows what its truths say, and the embedded toy
answers them as the generator's evaluation asks (a caption, then counts, colours, shapes and the
background)."""
import pytest

from dependencies import tool_script
from engine_checks import assert_block_pool_empty
from vlinfer import LLM
from vlinfer.loading import resolve_model
from vlinfer.toy import scenes

# Share of the 60 hand-drawn pictures' captions and answers right together (the issue's measure):
# 91.9% measured on tools/hand_drawn.py's set, minus the spread 6 points measured over it and three
# more sets of 60 (seeds SEED + 1..3: 85.9-91.9%), so another CPU's float order cannot fail it.
HAND_DRAWN_BAR = 0.919 - 0.06


def test_the_drawer_never_calls_the_generator(monkeypatch):
    """Same seed, same pictures; another seed, others; scenes.draw / random_scene are never used."""
    hand_drawn = tool_script("hand_drawn")

    def refuse(*args, **kwargs):
        raise AssertionError("the hand-drawn set must not use the generator")

    monkeypatch.setattr(scenes, "draw", refuse)
    monkeypatch.setattr(scenes, "random_scene", refuse)
    first, again = hand_drawn.hand_drawn(count=12), hand_drawn.hand_drawn(count=12)
    assert [a[1].tobytes() for a in first] == [b[1].tobytes() for b in again]
    assert [a[2] for a in first] == [b[2] for b in again]
    other = hand_drawn.hand_drawn(seed=hand_drawn.SEED + 1, count=12)
    assert [a[1].tobytes() for a in first] != [b[1].tobytes() for b in other]


def test_the_hand_drawn_set_lies_inside_the_world_and_shows_its_truths():
    """Canvases, object sizes and cells as world() states them, spanning its size range; each
    object's own paint at its centre (its truth is what is drawn there), the background's at an
    empty cell; every shape, colour, background and count 1-3 appear."""
    hand_drawn = tool_script("hand_drawn")
    drawn = hand_drawn.hand_drawn()
    low, high = scenes.across()
    sizes = []
    for scene, image, qa in drawn:
        assert (scene.width, scene.height) in scenes.SIZES and image.size == (scene.width,
                                                                               scene.height)
        cell_w, cell_h = scene.width / scenes.GRID, scene.height / scenes.GRID
        cells = set()
        for o in scene.objects:
            sizes.append(2 * o.half)
            assert low <= 2 * o.half <= high
            col, row = int(o.cx // cell_w), int(o.cy // cell_h)
            cells.add((col, row))
            assert col * cell_w <= o.cx - o.half and o.cx + o.half <= (col + 1) * cell_w
            assert row * cell_h <= o.cy - o.half and o.cy + o.half <= (row + 1) * cell_h
            paint = image.getpixel((int(o.cx), int(o.cy)))
            assert paint in hand_drawn.PAINT[o.colour], (o, paint)
        assert len(cells) == len(scene.objects)  # one object per cell
        empty = next((c, r) for c in range(scenes.GRID) for r in range(scenes.GRID)
                     if (c, r) not in cells)
        corner = image.getpixel((int(empty[0] * cell_w + 1), int(empty[1] * cell_h + 1)))
        assert corner in hand_drawn.PAPER[scene.background]
    assert max(sizes) - min(sizes) > (high - low) * 0.6
    assert {o.shape for s, _, _ in drawn for o in s.objects} == set(scenes.SHAPES)
    assert {o.colour for s, _, _ in drawn for o in s.objects} == set(scenes.COLOURS)
    assert {s.background for s, _, _ in drawn} == set(scenes.BACKGROUNDS)
    assert {len(s.objects) for s, _, _ in drawn} == set(range(1, scenes.MAX_OBJECTS + 1))


def test_toy_answers_hand_drawn_pictures():
    """60 hand-drawn pictures: 60 captions and ~345 answers, through the engine (~10 s)."""
    llm = LLM(resolve_model("qwen3-vl-toy").path, dtype="float32", max_model_len=1024,
              kv_cache_bytes=64 << 20)
    scores = tool_script("hand_drawn").score(llm)
    assert scores["accuracy"] >= HAND_DRAWN_BAR, {**scores, "failures": scores["failures"][:8]}
    assert_block_pool_empty(llm)
