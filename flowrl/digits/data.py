"""Real digits (scikit-learn's bundled `load_digits`), prompt parsing and the prompt sets of the digits world."""

from __future__ import annotations

import gzip
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch


DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "prompts" / "digits"
_PATTERN = re.compile(r"\b(" + "|".join(DIGIT_WORDS) + r"|[0-9])\b", re.IGNORECASE)


def digit_of(prompt: str) -> int:
    """The digit a prompt asks for: its only digit word (`seven`) or numeral (`7`)."""
    found = {m.lower() for m in _PATTERN.findall(prompt)}
    digits = {int(m) if m.isdigit() else DIGIT_WORDS.index(m) for m in found}
    if len(digits) != 1:
        what = "no digit" if not digits else f"several digits {sorted(digits)}"
        raise ValueError(f"digits prompt {prompt!r} names {what}; it must name exactly one (word or numeral)")
    return digits.pop()


def read_prompts(name: str) -> list[str]:
    """`train`, `test` or `val`: the shipped digits prompt set (one prompt per line, `#` comments)."""
    path = PROMPTS_DIR / f"{name}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"no digits prompt set {path}")
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@lru_cache(maxsize=1)
def real_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 images as `[N, 1, 8, 8]` floats in [0, 1] and their labels `[N]`: scikit-learn's bundled
    `load_digits` data, read from its file as `load_digits` reads it (importing scikit-learn costs a digits run about
    2 s of its start), or through `load_digits` where the file is not where scikit-learn 1.x keeps it."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None:
        raise ImportError('the digits world needs scikit-learn: pip install torch==2.13.0 -e ".[digits]"')
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        with gzip.open(path, "rt") as f:
            data = np.loadtxt(f, delimiter=",")  # [N, 65]: 64 pixels (0..16), then the label
        pixels, labels = data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    else:
        from sklearn.datasets import load_digits

        bundled = load_digits()
        pixels, labels = bundled.images, bundled.target
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(labels, dtype=torch.long)


def split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random half/half split of the real digits: `(indices_a, indices_b)`."""
    n = real_digits()[0].shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[: n // 2], order[n // 2 :]


def to_pixels(images: torch.Tensor) -> torch.Tensor:
    """Reward-facing `[B, 3, H, W]` images in [0, 1] back to the classifiers' `[B, 1, 8, 8]` grey digits."""
    grey = images.mean(dim=1, keepdim=True) if images.shape[1] == 3 else images
    if grey.shape[-2:] != (8, 8):
        grey = torch.nn.functional.interpolate(grey, size=(8, 8), mode="area")
    return grey.clamp(0, 1)
