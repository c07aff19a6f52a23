"""Text-rendering reward: OCR the image and compare with the text the prompt quotes (Flow-GRPO's OCR reward).

`ocr` follows Flow-GRPO's `OcrScorer` (`flow_grpo/ocr.py`; the same rule in DiffusionNFT and Flow-Factory):

- target: the prompt metadata's `text` when the prompt set gives one, else the first double-quoted span of the
  prompt (`flowrl.prompts.quoted_text`; `prompts.load` already puts it in `metadata["text"]`);
- recognised: the texts of every line the OCR engine returns, concatenated without a separator ("" if it finds none);
- normalisation of both strings: remove the spaces (`" "` only) and lower-case;
- `dist = 0` if the target is a substring of the recognised text, else the Levenshtein distance
  `lev(recognised, target)`, then clipped to `len(target)`;
- `reward = 1 - dist / len(target)`, in [0, 1]: 1 for the exact text, 0 for an image without text.

Example: target `"Hello World"` -> `helloworld`; read `"Hel1o World"` -> `hel1oworld`, distance 1, reward 0.9.

Prompts without a (non-blank) quoted span are refused up front (`check_prompts`, before any training) and at
scoring time with a `ValueError`; Flow-GRPO crashes on them too. An exception inside the OCR engine scores 0 (as in
Flow-GRPO) with a warning.

The engine is RapidOCR (`rapidocr-onnxruntime`, the `ocr` extra): PaddleOCR's PP-OCRv4 detection and recognition
networks as ONNX files inside the wheel, so nothing is downloaded; it runs on the CPU, created once per process on
first use, one image at a time. Flow-GRPO runs PaddleOCR 2.x (PP-OCR, `lang="en"`), so absolute scores can differ a
little from its numbers; the rule is the same.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import torch

from flowrl.rewards import register
from flowrl.rewards.base import Reward


_ENGINE = None
_ENGINE_LOCK = threading.Lock()


def engine():
    """The process's RapidOCR engine, created on first use (an `ImportError` naming the extra without it)."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as err:
                raise ImportError(
                    "reward 'ocr' needs RapidOCR: `pip install flowrl-toolkit[ocr]` (rapidocr-onnxruntime, which "
                    "ships its detection and recognition models)"
                ) from err
            _ENGINE = RapidOCR()
        return _ENGINE


def _levenshtein():
    """A maintained Levenshtein distance when installed (rapidfuzz, python-Levenshtein), else None."""
    import importlib

    for module in ("rapidfuzz.distance.Levenshtein", "Levenshtein"):
        try:
            return importlib.import_module(module).distance
        except ImportError:
            continue
    return None


_LEVENSHTEIN = _levenshtein()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions cost 1): rapidfuzz or python-Levenshtein when
    installed, else a two-row dynamic programme."""
    if _LEVENSHTEIN is not None:
        return int(_LEVENSHTEIN(a, b))
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def normalise(text: str) -> str:
    """Flow-GRPO's normalisation: spaces (`" "` only) removed, lower-cased."""
    return text.replace(" ", "").lower()


def ocr_reward(recognised: str, target: str) -> float:
    """`1 - min(dist, len(target)) / len(target)` on the normalised strings, `dist = 0` when the target is a
    substring of the recognised text, else their Levenshtein distance (Flow-GRPO's rule)."""
    recognised, target = normalise(recognised), normalise(target)
    if not target:
        raise ValueError("reward 'ocr': the target text is empty after removing spaces")
    dist = 0 if target in recognised else min(edit_distance(recognised, target), len(target))
    return 1.0 - dist / len(target)


def _target(prompt: str) -> str:
    from flowrl.prompts import quoted_text

    target = quoted_text(str(prompt))
    if target is None or not normalise(target):
        raise ValueError(
            f"reward 'ocr' reads its target text between double quotes; prompt {prompt!r} quotes none "
            '(write e.g. `a sign that says "Open"`, or give a `text` in the prompt metadata)'
        )
    return target


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """`[3, H, W]` in [0, 1] -> `[H, W, 3]` uint8 BGR (RapidOCR takes arrays as BGR), rounded as Flow-GRPO does."""
    rgb = (image.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    return np.ascontiguousarray(rgb[..., ::-1])


def read_text(image: torch.Tensor) -> str:
    """The text RapidOCR reads in one image `[3, H, W]` in [0, 1]: its lines concatenated ("" when none)."""
    result, _ = engine()(to_uint8(image))
    return "".join(line[1] for line in result or [])


@register(
    "ocr",
    description="1 - normalised edit distance between the prompt's quoted text and the OCR'd text, Flow-GRPO's "
    "text-rendering reward (needs: the `ocr` extra, rapidocr-onnxruntime; its models ship in the wheel)",
)
class OcrReward(Reward):
    """Flow-GRPO's OCR reward: how closely the text read in the image matches the prompt's quoted text.

    Args:
        device, dtype, batch_size: see `Reward` (the OCR engine itself always runs on the CPU, image by image).
    """

    def __init__(self, device=None, dtype: torch.dtype = torch.float32, batch_size: int = 32):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        import importlib.util

        if importlib.util.find_spec("rapidocr_onnxruntime") is None:  # fail at construction, not mid-run
            engine()

    def check_prompts(self, prompts) -> None:
        """Raise `ValueError` naming the first prompt without a quoted target text."""
        for prompt in prompts:
            _target(prompt)

    def score(self, images, prompts, text=None, **metadata):
        given = list(text) if text is not None else [None] * len(prompts)
        targets = [t if t else _target(p) for t, p in zip(given, prompts)]
        out = []
        for image, target in zip(images, targets):
            try:
                recognised = read_text(image)
            except Exception as err:  # Flow-GRPO: an OCR failure costs the whole target
                warnings.warn(f"reward 'ocr': the OCR engine failed ({err!r}); scoring 0", stacklevel=2)
                out.append(0.0)
                continue
            out.append(ocr_reward(recognised, target))
        return torch.tensor(out, dtype=torch.float32)
