"""A digits preference dataset, built offline from the digits world's own data (for offline Diffusion-DPO).

    python -m flowrl.digits.preferences DIR [--pairs 512] [--seed 0]

writes `DIR/preferences.jsonl` and `DIR/images/*.png` (8x8 grey PNGs) in the format of `flowrl.image.preferences`:
each row's prompt is a training phrasing of a digit, the chosen image a real handwritten digit of that class and
the rejected image a real digit of another class (uniform over the other nine). The images come from the half of
scikit-learn's digits the reward classifier was trained on (`split`'s first half), never from the half the gold
classifier learned, so the gold metric stays an outside judge.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flowrl.digits.data import digit_of, read_prompts, real_digits, split


def write_png(image: torch.Tensor, path: Path) -> None:
    """A `[1, H, W]` grey image in [0, 1] as an 8-bit PNG."""
    from PIL import Image

    pixels = (image[0].clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path)  # 2-D uint8: mode "L"


def build_digits_preferences(folder: str | Path, pairs: int = 512, seed: int = 0) -> Path:
    """Write `pairs` (prompt, chosen, rejected) rows and their images into `folder`; returns the JSONL path.

    Seeded: the same `(pairs, seed)` writes the same files."""
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    images, labels = real_digits()
    part = split(0)[0]  # the reward classifier's half of the real digits
    by_digit = [part[labels[part] == d] for d in range(10)]
    prompts = read_prompts("train")
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(pairs):
        prompt = prompts[int(torch.randint(len(prompts), (1,), generator=generator))]
        digit = digit_of(prompt)
        other = (digit + 1 + int(torch.randint(9, (1,), generator=generator))) % 10  # any digit but `digit`
        names = {}
        for key, d in (("chosen", digit), ("rejected", other)):
            pool = by_digit[d]
            index = int(pool[int(torch.randint(len(pool), (1,), generator=generator))])
            names[key] = f"images/{i:05d}_{key}.png"
            write_png(images[index], folder / names[key])
        rows.append({"prompt": prompt, **names})
    path = folder / "preferences.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the digits preference dataset (offline Diffusion-DPO).")
    parser.add_argument("folder", help="output folder (preferences.jsonl and images/)")
    parser.add_argument("--pairs", type=int, default=512, help="rows to write (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw (default 0)")
    args = parser.parse_args(argv)
    print(build_digits_preferences(args.folder, pairs=args.pairs, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
