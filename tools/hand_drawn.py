"""A held-out set of pictures drawn by hand, not by the toy's generator: the embedded toy's world
(vlinfer/toy/scenes.py world(): its canvases, backgrounds, shapes, colours, sizes and grid) drawn
with this file's own PIL code (its own palette, outlines of several widths, its own star, triangle
and house), objects of any size the world states anywhere inside their cell. Each picture comes with
its truth (a scenes.Scene), so the toy is asked what the generator's evaluation asks (a caption,
then counts, colours, shapes, the background: tools/train_embedded.py evaluate_items).

    python tools/hand_drawn.py                    # score the shipped toy on the set
    python tools/hand_drawn.py --save /tmp/drawn  # also write the pictures and their truths

Seeded: one seed, one set. Nothing here calls scenes.draw or scenes.random_scene."""
import argparse
import json
import math
import os
import random
import sys

from PIL import Image, ImageDraw

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vlinfer.toy import scenes  # noqa: E402

SEED = 5_000_000  # not a seed of the generator's training or evaluation
COUNT = 60
# This drawer's own paint: near the world's colour names, never the generator's swatches.
PAINT = {
    "red": [(226, 28, 36), (190, 30, 45)], "green": [(34, 139, 34), (60, 179, 90)],
    "blue": [(30, 80, 200), (65, 105, 225)], "yellow": [(255, 215, 0), (245, 222, 60)],
    "purple": [(128, 48, 160), (155, 70, 200)], "orange": [(255, 140, 0), (235, 120, 40)]
}
PAPER = {"white": [(255, 255, 255), (238, 236, 230)], "grey": [(128, 128, 128), (165, 165, 160)],
         "black": [(0, 0, 0), (40, 38, 36)]}


def _darker(rgb, factor: float = 0.55):
    return tuple(int(c * factor) for c in rgb)


def _pen(rng: random.Random, paint):
    """An outline: none, the paint's darker shade or black, 1 to 4 pixels wide."""
    width = rng.choice((0, 1, 2, 3, 4))
    if not width:
        return {}
    return dict(outline=rng.choice((_darker(paint), (20, 20, 20))), width=width)


def _circle(d, cx, cy, r, paint, pen):
    d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=paint, **pen)


def _square(d, cx, cy, r, paint, pen):
    d.polygon([(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=paint,
              **pen)


def _triangle(d, cx, cy, r, paint, pen):
    # equilateral, pointing up, as wide as the box
    height = r * math.sqrt(3)
    top = cy - height / 2
    d.polygon([(cx, top), (cx + r, top + height), (cx - r, top + height)], fill=paint, **pen)


def _star(d, cx, cy, r, paint, pen):
    # five points, the inner radius a regular pentagram's
    inner = r * 0.382
    points = [(cx + (r if k % 2 == 0 else inner) * math.sin(k * math.pi / 5),
               cy - (r if k % 2 == 0 else inner) * math.cos(k * math.pi / 5)) for k in range(10)]
    d.polygon(points, fill=paint, **pen)


def _house(d, cx, cy, r, paint, pen):
    # a body of 60% the height under a roof of the same paint darker, with a door
    eave = cy - 0.2 * r
    d.rectangle((cx - 0.8 * r, eave, cx + 0.8 * r, cy + r), fill=paint, **pen)
    d.polygon([(cx - r, eave), (cx, cy - r), (cx + r, eave)], fill=_darker(paint, 0.7), **pen)
    d.rectangle((cx - 0.15 * r, cy + 0.35 * r, cx + 0.15 * r, cy + r), fill=(70, 45, 30))


DRAW = {"circle": _circle, "square": _square, "triangle": _triangle, "star": _star,
        "house": _house}


def picture(rng: random.Random) -> tuple[scenes.Scene, Image.Image]:
    """One hand-drawn picture of the world and the scene it shows."""
    width, height = rng.choice(scenes.SIZES)
    background = rng.choice(sorted(scenes.BACKGROUNDS))
    img = Image.new("RGB", (width, height), rng.choice(PAPER[background]))
    d = ImageDraw.Draw(img)
    low, high = scenes.across()
    cell_w, cell_h = width / scenes.GRID, height / scenes.GRID
    objects = []
    for cell in rng.sample(range(scenes.GRID ** 2), rng.randint(1, scenes.MAX_OBJECTS)):
        shape, colour = rng.choice(scenes.SHAPES), rng.choice(sorted(scenes.COLOURS))
        if objects and rng.random() < 0.3:  # repeats, so counting is asked
            shape, colour = objects[-1].shape, objects[-1].colour
        # any size the world states that fits the cell, anywhere in it
        r = rng.uniform(low, min(high, min(cell_w, cell_h) - 4)) / 2
        cx = (cell % scenes.GRID) * cell_w + rng.uniform(r + 2, cell_w - r - 2)
        cy = (cell // scenes.GRID) * cell_h + rng.uniform(r + 2, cell_h - r - 2)
        paint = rng.choice(PAINT[colour])
        DRAW[shape](d, cx, cy, r, paint, _pen(rng, paint))
        objects.append(scenes.SceneObject(shape, colour, cx, cy, r))
    return scenes.Scene(width, height, background, tuple(objects)), img


def hand_drawn(seed: int = SEED, count: int = COUNT) -> list:
    """`count` pictures: (scene, picture, questions with answers), as scenes.generate gives them."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        scene, img = picture(rng)
        out.append((scene, img, scenes.questions(scene, rng)))
    return out


def score(model, seed: int = SEED, count: int = COUNT, **llm_kwargs) -> dict:
    """The generator's evaluation (train_embedded.evaluate_items) on the hand-drawn set; "accuracy"
    is the share of captions and answers right together."""
    import train_embedded
    return train_embedded.evaluate_items(model, hand_drawn(seed, count), **llm_kwargs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-vl-toy", help="a model name or folder")
    p.add_argument("--compact", help="a compact toy folder (tools/train_embedded.py --out)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--count", type=int, default=COUNT)
    p.add_argument("--save", help="write the pictures and truths.json here")
    args = p.parse_args(argv)
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        truths = []
        for i, (scene, img, qa) in enumerate(hand_drawn(args.seed, args.count)):
            img.save(os.path.join(args.save, f"{i:03d}.png"))
            truths.append(dict(file=f"{i:03d}.png", caption=scenes.caption(scene), questions=qa))
        with open(os.path.join(args.save, "truths.json"), "w") as f:
            json.dump(truths, f, indent=1)
    model = args.model
    if args.compact:
        import tempfile

        from vlinfer.toy import embedded
        model = embedded.build_checkpoint(args.compact, tempfile.mkdtemp())
    scores = score(model, args.seed, args.count, dtype="float32", max_model_len=512,
                   kv_cache_bytes=256 << 20)
    import train_embedded
    train_embedded.print_scores(scores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
