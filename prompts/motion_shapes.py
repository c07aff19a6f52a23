"""`motion_shapes/train`, `motion_shapes/test`: an offline image-to-video set drawn in code (no image files ship).

Each row is a start frame (one coloured square, circle or triangle on a white 64 x 64 canvas, drawn as the editing
set `edit_shapes` draws them) and a prompt that asks for a motion ("the red circle moves to the left"). Its metadata
names what the video should keep and do: `region` (the shape's bounding box `[x0, y0, x1, y1]` in the start frame,
as fractions of the image), `shape`, `color` (the shape's RGB in [0, 1]) and `direction` (`left`, `right`, `up`,
`down`). The two splits draw from disjoint seeds.
"""

from __future__ import annotations

import random

from flowrl.prompts import Prompt
from flowrl.prompts.edit_shapes import COLORS, SHAPES, SIZE, draw


DIRECTIONS = ("left", "right", "up", "down")


def rows(n: int, seed: int, size: int = SIZE) -> list[Prompt]:
    """`n` image-to-video prompts drawn from `seed`: a random shape, colour, size and place, and a direction."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shape, color, direction = rng.choice(SHAPES), rng.choice(sorted(COLORS)), rng.choice(DIRECTIONS)
        side = rng.randint(size // 4, size // 3)
        x0, y0 = rng.randint(size // 4, size - side - size // 4), rng.randint(size // 4, size - side - size // 4)
        box = (x0, y0, x0 + side, y0 + side)
        metadata = {
            "region": [round(v / size, 4) for v in box],
            "shape": shape,
            "color": [round(c / 255, 4) for c in COLORS[color]],
            "direction": direction,
        }
        out.append(Prompt(f"the {color} {shape} moves {direction}", metadata, (draw(shape, color, box, size),)))
    return out


def train() -> list[Prompt]:
    """32 training start frames."""
    return rows(32, seed=0)


def test() -> list[Prompt]:
    """8 held-out start frames (another seed)."""
    return rows(8, seed=1)
