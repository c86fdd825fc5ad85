"""Draws the example images with PIL, from shapes only, so the project owns them outright.

    python examples/images/draw.py      # rewrites the PNGs next to this file

Licence of the drawings: CC0 1.0 (public domain dedication); they were drawn by this script for vlinfer.
Every drawing is deterministic (no randomness), so rerunning the script reproduces the committed files.
"""
import math
import os

from PIL import Image, ImageDraw

HERE = os.path.dirname(os.path.abspath(__file__))
W, H = 320, 240


def sunset() -> Image.Image:
    """A sunset over the sea: orange-to-purple sky, a half-sunk sun, its reflection on dark water."""
    img = Image.new("RGB", (W, H))
    d = ImageDraw.Draw(img)
    horizon = 150
    for y in range(horizon):  # sky gradient, purple at the top to orange at the horizon
        t = y / horizon
        d.line([(0, y), (W, y)], fill=(int(70 + 185 * t), int(30 + 110 * t), int(110 - 70 * t)))
    d.ellipse([115, horizon - 45, 205, horizon + 45], fill=(255, 215, 80))  # the sun, half below the horizon
    for y in range(horizon, H):  # the sea, darker further down
        t = (y - horizon) / (H - horizon)
        d.line([(0, y), (W, y)], fill=(int(30 - 20 * t), int(50 - 30 * t), int(100 - 40 * t)))
    for i, y in enumerate(range(horizon + 6, H, 10)):  # the sun's broken reflection
        half = 40 - 3 * i
        if half > 4:
            d.line([(160 - half, y), (160 + half, y)], fill=(250, 180, 70), width=3)
    for x in (60, 75):  # two distant birds
        d.arc([x, 50, x + 12, 60], 200, 340, fill=(40, 20, 40), width=2)
        d.arc([x + 12, 50, x + 24, 60], 200, 340, fill=(40, 20, 40), width=2)
    return img


def red_house() -> Image.Image:
    """A red house with a dark roof, a door and two windows, on grass under a blue sky with a sun."""
    img = Image.new("RGB", (W, H), (135, 200, 245))
    d = ImageDraw.Draw(img)
    d.rectangle([0, 185, W, H], fill=(90, 170, 70))  # grass
    d.ellipse([255, 20, 295, 60], fill=(255, 225, 60))  # sun
    d.rectangle([90, 110, 230, 200], fill=(200, 35, 35), outline=(120, 20, 20), width=2)  # walls
    d.polygon([(75, 112), (160, 45), (245, 112)], fill=(80, 50, 40))  # roof
    d.rectangle([195, 55, 212, 85], fill=(110, 60, 50))  # chimney
    d.rectangle([145, 145, 175, 200], fill=(95, 60, 30))  # door
    d.ellipse([167, 170, 172, 175], fill=(230, 200, 80))  # door knob
    for x in (105, 190):  # windows with crossbars
        d.rectangle([x, 130, x + 25, 155], fill=(200, 235, 255), outline=(255, 255, 255), width=2)
        d.line([(x + 12, 130), (x + 12, 155)], fill=(255, 255, 255), width=2)
        d.line([(x, 142), (x + 25, 142)], fill=(255, 255, 255), width=2)
    return img


def bar_chart() -> Image.Image:
    """A bar chart: five coloured bars of heights 3, 7, 5, 9, 4 on a grid, with axes."""
    img = Image.new("RGB", (W, H), (255, 255, 255))
    d = ImageDraw.Draw(img)
    left, bottom, top, unit = 40, 210, 20, 20
    for v in range(0, 10, 2):  # grid lines every 2 units
        y = bottom - v * unit
        d.line([(left, y), (W - 15, y)], fill=(225, 225, 225))
        d.text((left - 18, y - 6), str(v), fill=(60, 60, 60))
    colors = [(66, 133, 244), (219, 68, 55), (244, 180, 0), (15, 157, 88), (171, 71, 188)]
    for i, (value, color) in enumerate(zip([3, 7, 5, 9, 4], colors)):
        x = left + 15 + i * 53
        d.rectangle([x, bottom - value * unit, x + 36, bottom], fill=color)
        d.text((x + 14, bottom + 6), "ABCDE"[i], fill=(30, 30, 30))
    d.line([(left, top), (left, bottom), (W - 15, bottom)], fill=(0, 0, 0), width=2)  # axes
    return img


def traffic_light() -> Image.Image:
    """A traffic light on a pole against a grey sky: red lit, amber and green dark."""
    img = Image.new("RGB", (W, H), (190, 200, 210))
    d = ImageDraw.Draw(img)
    d.rectangle([150, 180, 170, H], fill=(70, 70, 70))  # pole
    d.rounded_rectangle([120, 15, 200, 185], radius=14, fill=(35, 35, 35))  # housing
    lamps = [((230, 30, 30), True), ((110, 80, 20), False), ((20, 80, 35), False)]
    for i, (color, lit) in enumerate(lamps):
        y = 25 + i * 53
        if lit:  # a soft glow around the lit lamp
            d.ellipse([130 - 6, y - 6, 190 + 6, y + 50], fill=(120, 40, 40))
        d.ellipse([135, y, 185, y + 44], fill=color)
    return img


def cat_face() -> Image.Image:
    """A grey cat's face from shapes: round head, triangle ears, green eyes, pink nose, whiskers."""
    img = Image.new("RGB", (W, H), (250, 240, 215))
    d = ImageDraw.Draw(img)
    cx, cy, r = 160, 135, 85
    grey, dark = (150, 150, 155), (60, 60, 65)
    for side in (-1, 1):  # ears, drawn before the head so the head overlaps their base
        d.polygon([(cx + side * 80, cy - 30), (cx + side * 70, cy - 115), (cx + side * 20, cy - 75)], fill=grey)
        d.polygon([(cx + side * 68, cy - 45), (cx + side * 64, cy - 98), (cx + side * 32, cy - 72)],
                  fill=(235, 170, 180))
    d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=grey, outline=dark, width=2)
    for side in (-1, 1):
        ex = cx + side * 35
        d.ellipse([ex - 16, cy - 35, ex + 16, cy - 5], fill=(120, 200, 80), outline=dark, width=2)  # eyes
        d.ellipse([ex - 4, cy - 33, ex + 4, cy - 7], fill=(20, 20, 20))  # slit pupils
        for k in (-1, 0, 1):  # whiskers
            angle = math.radians(8 * k)
            x0, y0 = cx + side * 25, cy + 25 + 6 * k
            d.line([(x0, y0), (x0 + side * 90 * math.cos(angle), y0 + 90 * math.sin(angle))], fill=dark, width=2)
    d.polygon([(cx - 10, cy + 10), (cx + 10, cy + 10), (cx, cy + 22)], fill=(235, 120, 140))  # nose
    d.arc([cx - 20, cy + 18, cx, cy + 38], 0, 180, fill=dark, width=2)  # mouth
    d.arc([cx, cy + 18, cx + 20, cy + 38], 0, 180, fill=dark, width=2)
    return img


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
