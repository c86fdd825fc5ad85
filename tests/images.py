"""Seeded test pictures: a random base colour, a horizontal ramp and per-pixel noise, so two seeds never collide."""
import numpy as np
from PIL import Image


def picture(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    base = rng.randint(0, 255, (1, 1, 3)) + np.linspace(0, 60, w)[None, :, None] + rng.randint(0, 40, (h, w, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
