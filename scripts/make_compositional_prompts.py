"""Write prompts/compositional/{train,test}.jsonl: compositional prompts with metadata a detector can check.

Each line is `{"prompt": ..., "tag": ..., "include": [...], "exclude": [...]}` in the GenEval convention: `include`
lists the objects that must be detected (`class`, `count`, optionally `color` and `position = [relation, index]`,
meaning "this object is <relation> the object at `index` of `include`"), `exclude` the ones that must not (e.g.
one object too many for counting prompts). A GenEval-style reward (object detector + colour classifier) scores
an image by checking these clauses. Tags: `single_object`, `two_object`, `counting`, `colors`, `position`,
`color_attr`. Objects are COCO classes (what COCO-trained detectors find).

The output is deterministic (fixed seed); train and test prompts are disjoint. Run from the repository root:

    python scripts/make_compositional_prompts.py            # writes prompts/compositional/
    python scripts/make_compositional_prompts.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path


# (singular, plural) of COCO classes that read naturally in prompts.
OBJECTS = [
    ("bicycle", "bicycles"), ("car", "cars"), ("motorcycle", "motorcycles"), ("airplane", "airplanes"),
    ("bus", "buses"), ("train", "trains"), ("truck", "trucks"), ("boat", "boats"), ("traffic light", "traffic lights"),
    ("fire hydrant", "fire hydrants"), ("stop sign", "stop signs"), ("bench", "benches"), ("bird", "birds"),
    ("cat", "cats"), ("dog", "dogs"), ("horse", "horses"), ("sheep", "sheep"), ("cow", "cows"),
    ("elephant", "elephants"), ("bear", "bears"), ("zebra", "zebras"), ("giraffe", "giraffes"),
    ("backpack", "backpacks"), ("umbrella", "umbrellas"), ("handbag", "handbags"), ("tie", "ties"),
    ("suitcase", "suitcases"), ("frisbee", "frisbees"), ("kite", "kites"), ("skateboard", "skateboards"),
    ("surfboard", "surfboards"), ("tennis racket", "tennis rackets"), ("bottle", "bottles"),
    ("wine glass", "wine glasses"), ("cup", "cups"), ("fork", "forks"), ("knife", "knives"), ("spoon", "spoons"),
    ("bowl", "bowls"), ("banana", "bananas"), ("apple", "apples"), ("sandwich", "sandwiches"),
    ("orange", "oranges"), ("carrot", "carrots"), ("donut", "donuts"), ("cake", "cakes"),
    ("chair", "chairs"), ("couch", "couches"), ("potted plant", "potted plants"), ("bed", "beds"),
    ("dining table", "dining tables"), ("toilet", "toilets"), ("tv", "tvs"), ("laptop", "laptops"),
    ("mouse", "mice"), ("keyboard", "keyboards"), ("cell phone", "cell phones"), ("microwave", "microwaves"),
    ("oven", "ovens"), ("sink", "sinks"), ("refrigerator", "refrigerators"), ("book", "books"), ("clock", "clocks"),
    ("vase", "vases"), ("teddy bear", "teddy bears"), ("toothbrush", "toothbrushes"),
]  # fmt: skip
COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
NUMBERS = {2: "two", 3: "three", 4: "four"}
# metadata relation (GenEval's names) -> wording in the prompt
RELATIONS = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}
# (train, test) prompts per tag
SIZES = {
    "single_object": (48, 18),
    "two_object": (600, 100),
    "counting": (156, 42),
    "colors": (400, 80),
    "position": (600, 100),
    "color_attr": (600, 100),
}
SEED = 0


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def single_object(rng):
    for name, _ in OBJECTS:
        yield {"prompt": f"a photo of {article(name)} {name}", "include": [{"class": name, "count": 1}]}


def two_object(rng):
    for (a, _), (b, _) in itertools.permutations(OBJECTS, 2):
        yield {
            "prompt": f"a photo of {article(a)} {a} and {article(b)} {b}",
            "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
        }


def counting(rng):
    for (name, plural), (n, word) in itertools.product(OBJECTS, NUMBERS.items()):
        yield {
            "prompt": f"a photo of {word} {plural}",
            "include": [{"class": name, "count": n}],
            "exclude": [{"class": name, "count": n + 1}],
        }


def colors(rng):
    for (name, _), color in itertools.product(OBJECTS, COLORS):
        yield {
            "prompt": f"a photo of {article(color)} {color} {name}",
            "include": [{"class": name, "count": 1, "color": color}],
        }


def position(rng):
    for ((a, _), (b, _)), (relation, words) in itertools.product(
        itertools.permutations(OBJECTS, 2), RELATIONS.items()
    ):
        yield {
            "prompt": f"a photo of {article(a)} {a} {words} {article(b)} {b}",
            "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}],
        }


def color_attr(rng):
    for (a, _), (b, _) in itertools.permutations(OBJECTS, 2):
        ca, cb = rng.sample(COLORS, 2)
        yield {
            "prompt": f"a photo of {article(ca)} {ca} {a} and {article(cb)} {cb} {b}",
            "include": [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}],
        }


GENERATORS = {
    "single_object": single_object,
    "two_object": two_object,
    "counting": counting,
    "colors": colors,
    "position": position,
    "color_attr": color_attr,
}


def build(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """`(train, test)` records; within each tag the candidates are shuffled, test takes the first ones."""
    rng = random.Random(seed)
    train, test = [], []
    for tag, generate in GENERATORS.items():
        candidates = [
            {"prompt": c["prompt"], "tag": tag, **{k: v for k, v in c.items() if k != "prompt"}} for c in generate(rng)
        ]
        rng.shuffle(candidates)
        n_train, n_test = SIZES[tag]
        if n_train + n_test > len(candidates):
            raise ValueError(f"{tag}: {len(candidates)} candidates for {n_train} + {n_test} prompts")
        test += candidates[:n_test]
        train += candidates[n_test : n_test + n_train]
    rng.shuffle(train)
    return train, test


def write(records: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parents[1]
    parser.add_argument("--out", type=Path, default=root / "prompts" / "compositional", help="output folder")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    train, test = build(args.seed)
    write(train, args.out / "train.jsonl")
    write(test, args.out / "test.jsonl")
    print(f"wrote {len(train)} train and {len(test)} test prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
