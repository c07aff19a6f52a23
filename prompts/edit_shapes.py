"""`edit_shapes/train`, `edit_shapes/test`: an offline editing set drawn in code (no image files ship).

Each row is a PIL-drawn source image (one coloured square, circle or triangle on a white 64 x 64 canvas) and an
instruction that recolours it ("make the square red"). Its metadata names what the edit should touch, for weight-free
rewards (`flowrl.rewards.edit`): `region` (the shape's bounding box `[x0, y0, x1, y1]` as fractions of the image),
`color` (the target RGB in [0, 1]), `shape` and `source_color`. The two splits draw from disjoint seeds.
"""

from __future__ import annotations

import random

from flowrl.prompts import Prompt


COLORS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
SHAPES = ("square", "circle", "triangle")
SIZE = 64


def draw(shape: str, color: str, box: tuple[int, int, int, int], size: int = SIZE):
    """A white `size` x `size` RGB image with one filled `shape` of `color` inside `box` (pixels, inclusive)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    fill = COLORS[color]
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        x0, y0, x1, y1 = box
        pen.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image


def rows(n: int, seed: int, size: int = SIZE) -> list[Prompt]:
    """`n` editing prompts drawn from `seed`: a random shape, colour, size and place, and a new colour."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shape, source = rng.choice(SHAPES), rng.choice(sorted(COLORS))
        target = rng.choice([c for c in sorted(COLORS) if c != source])
        side = rng.randint(size // 4, size // 2)
        x0, y0 = rng.randint(2, size - side - 2), rng.randint(2, size - side - 2)
        box = (x0, y0, x0 + side, y0 + side)
        metadata = {
            "region": [round(v / size, 4) for v in box],
            "color": [round(c / 255, 4) for c in COLORS[target]],
            "shape": shape,
            "source_color": source,
        }
        out.append(Prompt(f"make the {shape} {target}", metadata, (draw(shape, source, box, size),)))
    return out


def train() -> list[Prompt]:
    """32 training edits."""
    return rows(32, seed=0)


def test() -> list[Prompt]:
    """8 held-out edits (another seed)."""
    return rows(8, seed=1)
