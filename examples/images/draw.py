"""Draws the example images with PIL, from shapes only, so the project owns them outright. They are
scenes of the world the embedded toy Qwen3-VL was trained on (vlinfer/toy/scenes.py).

    python examples/images/draw.py      # rewrites the PNGs next to this file

Licence of the drawings: CC0 1.0 (public domain dedication); they were drawn by this script for
vlinfer. Every drawing is deterministic (scenes.draw's colour jitter has a fixed seed), so rerunning
the script reproduces the committed files.
"""
import os

from PIL import Image

from vlinfer.toy import scenes

HERE = os.path.dirname(os.path.abspath(__file__))
W, H = 320, 240


def _scene(background: str, *objects) -> Image.Image:
    """A scene of the embedded toy model's world (vlinfer/toy/scenes.py): (shape, colour, grid cell,
    size) per object, cells 0..8 of the 3 x 3 layout read row by row, size as a fraction of the cell
    (0.28 .. 0.44 in training)."""
    cell_w, cell_h = W / scenes.GRID, H / scenes.GRID
    placed = tuple(
        scenes.SceneObject(shape, colour, (cell % scenes.GRID + 0.5) *
                           cell_w, (cell // scenes.GRID + 0.5) * cell_h, size * min(cell_w, cell_h))
        for shape, colour, cell, size in objects)
    return scenes.draw(scenes.Scene(W, H, background, placed))


def red_house() -> Image.Image:
    """A big red house with a yellow sun (a circle) high on its right, on a white background."""
    return _scene("white", ("house", "red", 4, 0.44), ("circle", "yellow", 2, 0.36))


def sunset() -> Image.Image:
    """An orange sun (a circle) over two purple mountains (triangles), on a black background."""
    return _scene("black", ("circle", "orange", 1, 0.4), ("triangle", "purple", 6, 0.44),
                  ("triangle", "purple", 8, 0.44))


def bar_chart() -> Image.Image:
    """Three squares in a row, like the bars of a chart: red, green and blue, on a white background.
    """
    return _scene("white", ("square", "red", 6, 0.4), ("square", "green", 7, 0.4),
                  ("square", "blue", 8, 0.4))


def traffic_light() -> Image.Image:
    """A traffic light's three lamps: red over yellow over green circles, on a black background."""
    return _scene("black", ("circle", "red", 1, 0.42), ("circle", "yellow", 4, 0.42),
                  ("circle", "green", 7, 0.42))


def cat_face() -> Image.Image:
    """A cat's face from shapes: an orange circle head between two orange triangle ears, on a grey
    background."""
    return _scene("grey", ("triangle", "orange", 0, 0.4), ("triangle", "orange", 2, 0.4),
                  ("circle", "orange", 4, 0.44))


DRAWINGS = {"sunset.png": sunset, "red_house.png": red_house, "bar_chart.png": bar_chart,
            "traffic_light.png": traffic_light, "cat_face.png": cat_face}


def main() -> None:
    for name, draw in DRAWINGS.items():
        path = os.path.join(HERE, name)
        draw().save(path, optimize=True)
        size = os.path.getsize(path)
        assert size <= 60 * 1024, f"{name} is {size} bytes, over the 60 KB budget"
        print(f"{path}: {size} bytes")


if __name__ == "__main__":
    main()
