"""Write prompts/ocr/{train,test}.txt: text-rendering prompts whose target text is the quoted span.

Each prompt places a short text on an everyday surface, e.g. `a neon sign that reads "Hot Coffee"`. An OCR
reward reads the target from the first double-quoted span (`prompts.load` puts it in `metadata["text"]`), as
Flow-GRPO's OCR reward does. Texts are split between train and test, so test texts are never seen in training.
Deterministic (fixed seed). Run from the repository root:

    python scripts/make_ocr_prompts.py            # writes prompts/ocr/
    python scripts/make_ocr_prompts.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import random
from pathlib import Path


SURFACES = [
    'a wooden sign that says "{}"',
    'a neon sign that reads "{}"',
    'a storefront with a sign reading "{}"',
    'a chalkboard outside a cafe that says "{}"',
    'a white t-shirt printed with "{}"',
    'a coffee mug with "{}" written on it',
    'a book cover with the title "{}"',
    'a highway billboard that says "{}"',
    'a birthday cake decorated with the words "{}"',
    'a handwritten note on lined paper that says "{}"',
    'a poster on a brick wall that reads "{}"',
    'a green street sign that says "{}"',
    'a banner hanging across a street that reads "{}"',
    'a paper shopping bag stamped with "{}"',
    'a glowing sign above a door that says "{}"',
    'a laptop sticker that says "{}"',
    'a food truck with "{}" painted on the side',
    'a greeting card that says "{}"',
    'a letter board on a kitchen counter that says "{}"',
    'a sandwich board on a sidewalk that reads "{}"',
    'a vintage tin can labeled "{}"',
    'a bus stop advertisement that says "{}"',
    'a graffiti mural that spells "{}"',
    'a wooden crate stamped with "{}"',
]
ADJECTIVES = [
    "Fresh", "Hot", "Cold", "Free", "Open", "Happy", "Quiet", "Big", "Little", "Best", "Lucky", "Golden",
    "Wild", "Sweet", "Daily", "Good", "Night", "Sunny", "Local", "Magic",
]  # fmt: skip
NOUNS = [
    "Coffee", "Bread", "Books", "Pizza", "Flowers", "Music", "Garden", "Market", "Tea", "Donuts", "Juice", "Cinema",
    "Bakery", "Ideas", "Kitchen", "Records", "Bikes", "Tacos", "Vibes", "Noodles",
]  # fmt: skip
PHRASES = [
    "Hello World", "Stay Curious", "Keep Going", "Welcome Home", "Do Not Disturb", "Back Soon", "Thank You",
    "Good Morning", "Dream Big", "Be Kind", "No Parking", "Exit Only", "Push", "Pull", "Sale", "Closed",
    "Live Music Tonight", "Wet Paint", "Slow Down", "Think Green", "Save Water", "Lost Cat", "Yard Sale",
    "Room 404", "Gate 12", "Route 66", "Since 1987", "Est 2024", "Aisle 7", "Level 3", "Pier 39", "Table 5",
    "Love", "Peace", "Hope", "Joy", "Relax", "Focus", "Breathe", "Smile",
]  # fmt: skip
N_TEST_TEXTS = 80
PER_TRAIN_TEXT = 2
SEED = 0


def build(seed: int = SEED) -> tuple[list[str], list[str]]:
    """`(train, test)` prompts; texts are disjoint between the splits, surfaces are shared."""
    rng = random.Random(seed)
    texts = [f"{a} {n}" for a, n in itertools.product(ADJECTIVES, NOUNS)] + PHRASES
    rng.shuffle(texts)
    test_texts, train_texts = texts[:N_TEST_TEXTS], texts[N_TEST_TEXTS:]
    test = [rng.choice(SURFACES).format(t) for t in test_texts]
    train = [surface.format(t) for t in train_texts for surface in rng.sample(SURFACES, PER_TRAIN_TEXT)]
    rng.shuffle(train)
    return train, test


def write(prompts: list[str], path: Path, split: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# OCR {split} prompts, written by scripts/make_ocr_prompts.py; the target text is the quoted span.\n"
    path.write_text(header + "".join(p + "\n" for p in prompts), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parents[1]
    parser.add_argument("--out", type=Path, default=root / "prompts" / "ocr", help="output folder")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    train, test = build(args.seed)
    write(train, args.out / "train.txt", "train")
    write(test, args.out / "test.txt", "test")
    print(f"wrote {len(train)} train and {len(test)} test prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
