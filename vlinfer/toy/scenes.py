"""The toy world the embedded Qwen3-VL knows: seeded drawings of a few coloured shapes on a plain
background, each with its true caption and simple question / answer pairs. tools/train_embedded.py
trains on them; the tests score the trained model on scenes from a seed training never used;
examples/images/draw.py draws the example pictures in it. PIL only: a scene is a small spec
(background, objects) and the drawing follows from it."""
import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star", "house")
PLURAL = {
    "circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars",
    "house": "houses"
}
COLOURS = {
    "red": (215, 40, 40), "green": (40, 165, 60), "blue": (45, 95, 225), "yellow": (240, 205, 35),
    "purple": (140, 60, 185), "orange": (245, 135, 25)
}
BACKGROUNDS = {"white": (248, 248, 248), "grey": (150, 150, 150), "black": (22, 22, 22)}
NUMBERS = ("zero", "one", "two", "three", "four")
MAX_OBJECTS = 3
GRID = 3  # objects sit in distinct cells of a GRID x GRID layout, so they never overlap
# Canvas sizes (width, height) the world is drawn at: the examples' 320 x 240 and a few near it.
SIZES = ((320, 240), (256, 256), (240, 320), (288, 288))
# An object's half-size, as a share of its grid cell's shorter side.
HALF_SHARE = (0.28, 0.44)
# Room for every answer of the world (its longest caption is about 20 tokens): a Pipeline's default
# max_tokens on the toys, so a picture outside the world cannot loop for 512 tokens.
MAX_ANSWER_TOKENS = 48
CAPTION_PROMPTS = ("Describe this image.", "Describe the image.", "Describe this picture.",
                   "What is in this image?", "What is in this picture?", "What do you see?",
                   "Caption this image.")


def _either(words) -> str:
    words = list(words)
    return ", ".join(words[:-1]) + " or " + words[-1]


def across() -> tuple[int, int]:
    """The world's object sizes, in pixels across: the smallest and largest the canvases and
    HALF_SHARE give."""
    sizes = [2 * min(w, h) / GRID * share for w, h in SIZES for share in HALF_SHARE]
    return math.floor(min(sizes)), math.ceil(max(sizes))


def world() -> str:
    """Exactly what the toy was trained on, in one sentence (its notice and the README say it)."""
    low, high = across()
    sizes = _either([f"{w}x{h}" for w, h in SIZES])
    return (f"one picture per conversation, {sizes} pixels, a {_either(BACKGROUNDS)} background, "
            f"1 to {MAX_OBJECTS} objects ({', '.join(SHAPES)}; {', '.join(COLOURS)}) "
            f"{low}-{high} pixels across, apart in a {GRID}x{GRID} grid; no video, JSON or tools")


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    cx: float  # centre and half-size in pixels
    cy: float
    half: float


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: str
    objects: tuple

    def groups(self) -> list[tuple[str, str, int]]:
        """(colour, shape, count) per kind of object, in the caption's fixed order: by shape, then
        by colour."""
        counts = {}
        for o in self.objects:
            counts[(o.shape, o.colour)] = counts.get((o.shape, o.colour), 0) + 1
        order = sorted(counts, key=lambda k: (SHAPES.index(k[0]), list(COLOURS).index(k[1])))
        return [(colour, shape, counts[(shape, colour)]) for shape, colour in order]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _phrase(colour: str, shape: str, count: int) -> str:
    if count == 1:
        return f"{_article(colour)} {colour} {shape}"
    return f"{NUMBERS[count]} {colour} {PLURAL[shape]}"


def caption(scene: Scene) -> str:
    """'A red circle, two blue squares and a yellow star on a white background.'"""
    parts = [_phrase(*g) for g in scene.groups()]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    text = f"{listed} on {_article(scene.background)} {scene.background} background."
    return text[0].upper() + text[1:]


def parse_caption(text: str) -> dict:
    """What a caption states: {"objects": {(colour, shape): count}, "background": colour or None,
    "unplaced": words of the world (colours, shapes, numbers) that are not part of a '<count>
    <colour> <shape>' phrase or the background}. The evaluation compares all of it with the scene's
    own caption, counts included."""
    words = text.lower().replace(",", " ").replace(".", " ").split()
    singular = {**{s: (s, False) for s in SHAPES}, **{p: (s, True) for s, p in PLURAL.items()}}
    counts = {"a": 1, "an": 1, **{w: n for n, w in enumerate(NUMBERS)}}
    objects, background, used = {}, None, set()
    for i, w in enumerate(words):
        if w == "background" and i > 0 and words[i - 1] in BACKGROUNDS:
            background = words[i - 1]
            used |= {i - 1}
        if w not in singular or i < 2 or words[i - 1] not in COLOURS or words[i - 2] not in counts:
            continue
        shape, plural = singular[w]
        count = counts[words[i - 2]]
        if plural != (count != 1):  # "two red circle", "a red circles": not a phrase of the world
            continue
        key = (words[i - 1], shape)
        objects[key] = objects.get(key, 0) + count
        used |= {i - 2, i - 1, i}
    world = set(COLOURS) | set(BACKGROUNDS) | set(singular) | set(NUMBERS)
    unplaced = sorted(w for i, w in enumerate(words) if w in world and i not in used)
    return {"objects": objects, "background": background, "unplaced": unplaced}


def caption_is_right(text: str, scene: Scene) -> bool:
    """The caption states exactly the scene: each kind of object with its colour and number, and the
    background."""
    return parse_caption(text) == parse_caption(caption(scene))


def _answer(word: str) -> str:
    return word[0].upper() + word[1:] + "."


def questions(scene: Scene, rng: random.Random) -> list[tuple[str, str]]:
    """One question of each kind the scene can answer truthfully, with its answer (one word and a
    full stop)."""
    by_shape, by_colour = {}, {}
    for o in scene.objects:
        by_shape.setdefault(o.shape, set()).add(o.colour)
        by_colour.setdefault(o.colour, []).append(o.shape)
    present = {(o.colour, o.shape) for o in scene.objects}
    qa = []
    shape = rng.choice(sorted(by_shape))
    # every object of this shape has one colour: the question has one answer
    if len(by_shape[shape]) == 1:
        n = sum(o.shape == shape for o in scene.objects)
        q = f"What colour is the {shape}?" if n == 1 else f"What colour are the {PLURAL[shape]}?"
        qa.append((q, _answer(next(iter(by_shape[shape])))))
    shape = rng.choice(SHAPES)
    qa.append((f"How many {PLURAL[shape]} are there?",
               _answer(NUMBERS[sum(o.shape == shape for o in scene.objects)])))
    if rng.random() < 0.5:
        colour, shape = rng.choice(sorted(present))
    # a near miss: a kind of object that is not there, sharing its colour or shape with one that is
    else:
        colour, shape = rng.choice(sorted(present))
        while (colour, shape) in present:
            if rng.random() < 0.5:
                colour = rng.choice(list(COLOURS))
            else:
                shape = rng.choice(SHAPES)
    qa.append((f"Is there {_article(colour)} {colour} {shape}?", "Yes." if
               (colour, shape) in present else "No."))
    unique = [c for c, shapes in by_colour.items() if len(shapes) == 1]
    if unique:
        colour = rng.choice(sorted(unique))
        qa.append((f"What shape is the {colour} object?", _answer(by_colour[colour][0])))
    qa.append(("What colour is the background?", _answer(scene.background)))
    qa.append(("How many objects are there?", _answer(NUMBERS[len(scene.objects)])))
    return qa


def random_scene(rng: random.Random, max_objects: int = MAX_OBJECTS, count: int | None = None,
                 anywhere: bool = False) -> Scene:
    """1..max_objects objects, uniformly (training starts with few: one object teaches what each
    word looks like), or exactly `count` of them (the training chooses how often each count comes;
    the world's scenes are these). anywhere: each object of any size the world states (across())
    that fits its cell, on every canvas, instead of a share of its cell (the training's
    augmentation: a picture drawn by hand puts a large object on a small canvas)."""
    width, height = rng.choice(SIZES)
    background = rng.choice(list(BACKGROUNDS))
    cells = rng.sample(range(GRID * GRID), rng.randint(1, max_objects) if count is None else count)
    cell_w, cell_h = width / GRID, height / GRID
    objects = []
    # Repeats of one kind are common enough to teach counting: a later object copies an earlier
    # one's kind often.
    for i, cell in enumerate(cells):
        if i and rng.random() < 0.3:
            earlier = objects[rng.randrange(i)]
            shape, colour = earlier.shape, earlier.colour
        else:
            shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        if anywhere:
            low, high = across()
            half = rng.uniform(low, min(high, min(cell_w, cell_h) - 2)) / 2
        else:
            half = min(cell_w, cell_h) * rng.uniform(*HALF_SHARE)
        slack_x, slack_y = cell_w / 2 - half, cell_h / 2 - half
        cx = (cell % GRID + 0.5) * cell_w + rng.uniform(-slack_x, slack_x)
        cy = (cell // GRID + 0.5) * cell_h + rng.uniform(-slack_y, slack_y)
        objects.append(SceneObject(shape, colour, cx, cy, half))
    return Scene(width, height, background, tuple(objects))


def _jitter(rgb, rng: random.Random, amount: int = 12):
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)


def _star(cx, cy, half):
    points = []
    for k in range(10):
        r = half if k % 2 == 0 else half * 0.42
        angle = -math.pi / 2 + k * math.pi / 5
        points.append((cx + r * math.cos(angle), cy + r * math.sin(angle)))
    return points


def _draw_object(d: ImageDraw.ImageDraw, o: SceneObject, fill, flat: bool = False) -> None:
    """flat: every part in `fill` (the house's roof and door too), for object_index_map."""
    x0, y0, x1, y1 = o.cx - o.half, o.cy - o.half, o.cx + o.half, o.cy + o.half
    if o.shape == "circle":
        d.ellipse([x0, y0, x1, y1], fill=fill)
    elif o.shape == "square":
        d.rectangle([x0, y0, x1, y1], fill=fill)
    elif o.shape == "triangle":
        d.polygon([(o.cx, y0), (x1, y1), (x0, y1)], fill=fill)
    elif o.shape == "star":
        d.polygon(_star(o.cx, o.cy, o.half), fill=fill)
    elif o.shape == "house":  # walls in the colour, a darker roof of the same colour, a dark door
        roof = fill if flat else tuple(int(c * 0.6) for c in fill)
        wall_top = o.cy - 0.1 * o.half
        d.rectangle([x0 + 0.15 * o.half, wall_top, x1 - 0.15 * o.half, y1], fill=fill)
        d.polygon([(x0, wall_top + 1), (o.cx, y0), (x1, wall_top + 1)], fill=roof)
        if not flat:
            d.rectangle([o.cx - 0.18 * o.half, o.cy + 0.4 * o.half, o.cx + 0.18 * o.half, y1],
                        fill=(60, 40, 25))
    else:
        raise ValueError(f"unknown shape {o.shape!r}; the world has {SHAPES}")


def draw(scene: Scene, seed: int = 0) -> Image.Image:
    """The scene as an RGB picture; `seed` only varies the small colour jitter, never what is drawn.
    """
    rng = random.Random(seed)
    img = Image.new("RGB", (scene.width, scene.height),
                    _jitter(BACKGROUNDS[scene.background], rng, 8))
    d = ImageDraw.Draw(img)
    for o in scene.objects:
        _draw_object(d, o, _jitter(COLOURS[o.colour], rng))
    return img


def object_index_map(scene: Scene) -> Image.Image:
    """A greyscale picture of the scene's size: at each pixel 1 + the index of the object drawn
    there, 0 on the background (the training's per-location targets, tools/train_embedded.py)."""
    img = Image.new("L", (scene.width, scene.height), 0)
    d = ImageDraw.Draw(img)
    for i, o in enumerate(scene.objects):
        _draw_object(d, o, i + 1, flat=True)
    return img


def generate(seed: int, count: int) -> list[tuple[Scene, Image.Image, list[tuple[str, str]]]]:
    """`count` scenes of one seed: (scene, picture, questions with answers). Same seed, same scenes.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        scene = random_scene(rng)
        out.append((scene, draw(scene, rng.randrange(2 ** 31)), questions(scene, rng)))
    return out
