"""The digits world: flowrl's embedded, offline text-to-image task (see `docs/digits.md`).

A small flow model with the SD3 transformer architecture generates 8x8 handwritten digits from prompts
("a handwritten seven", "the number 7", ...) embedded by the real MiniLM text encoder; a CNN classifier gives
the reward (probability of the prompted digit), and held-out gold metrics (an independently trained MLP
classifier, realism and diversity against real digits) show over-optimisation.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file

from flowrl.digits.build import BuildConfig, build_classifiers, build_model
from flowrl.digits.data import DIGIT_WORDS, digit_of, read_prompts, real_digits, split, to_pixels
from flowrl.digits.nets import DigitCNN, DigitMLP, MiniLMEncoder


__all__ = [
    "DIGIT_WORDS",
    "BuildConfig",
    "DigitClassifiers",
    "DigitsWorld",
    "digit_of",
    "load_classifiers",
    "load_world",
    "read_prompts",
    "to_pixels",
]


@lru_cache(maxsize=1)
def _encoder() -> MiniLMEncoder:
    return MiniLMEncoder()


def decode(latents: torch.Tensor) -> torch.Tensor:
    """Pixel latents in [-1, 1] `[B, 1, 8, 8]` -> images `[B, 3, 8, 8]` in [0, 1]."""
    return ((latents.float() + 1) / 2).clamp(0, 1).expand(-1, 3, -1, -1)


def encode(images: torch.Tensor) -> torch.Tensor:
    """Images `[B, 3, H, W]` (or grey `[B, 1, H, W]`) in [0, 1] -> pixel latents `[B, 1, 8, 8]` in [-1, 1]: the
    inverse of `decode` (offline preference data)."""
    return to_pixels(images.float()) * 2 - 1


class DigitClassifiers:
    """The reward CNN and the gold MLP of a built classifier folder."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta = self.path / "meta.json"
        if not meta.is_file():
            raise FileNotFoundError(f"{self.path} holds no built digit classifiers (no meta.json)")
        self.meta = json.loads(meta.read_text())
        self.reward = self._load(DigitCNN(), "reward_classifier.safetensors")
        self.gold = self._load(DigitMLP(), "gold_classifier.safetensors")

    def _load(self, model, name):
        model.load_state_dict(load_file(self.path / name))
        return model.eval().requires_grad_(False)


class DigitsWorld:
    """A built digits world: the base model folder and the classifiers."""

    def __init__(self, model_path: str | Path, classifiers: DigitClassifiers):
        self.model_path = Path(model_path)
        if not (self.model_path / "meta.json").is_file():
            raise FileNotFoundError(f"{self.model_path} is not a built digits model; run flowrl digits build")
        self.meta = json.loads((self.model_path / "meta.json").read_text())
        self.classifiers = classifiers

    def transformer(self):
        """A fresh copy of the base flow model (its own parameters, ready to fine-tune)."""
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel.from_pretrained(self.model_path / "transformer").eval()

    def policy(self, *, forward_batch_size: int | None = None, **kwargs):
        """A `DiffusionPolicy` over a fresh base model, the MiniLM encoder and the pixel decoder."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        from flowrl.policies import from_callable

        encoder = _encoder()
        return from_callable(
            self.transformer(),
            encoder.encode,
            decode,
            (1, 8, 8),
            FlowMatchEulerDiscreteScheduler(shift=1.0),
            encode_images=encode,
            forward_batch_size=forward_batch_size,
            **kwargs,
        )


def load_classifiers(config: BuildConfig | None = None, *, log=print) -> DigitClassifiers:
    """The digit classifiers for `config`, trained into the cache on first use (seconds)."""
    return DigitClassifiers(build_classifiers(config or BuildConfig(), log=log))


def load_world(config: BuildConfig | None = None, *, log=print) -> DigitsWorld:
    """The digits world for `config` (default `BuildConfig()`), built into the cache on first use."""
    config = config or BuildConfig()
    return DigitsWorld(build_model(config, log=log), load_classifiers(config, log=log))


def real_by_digit() -> list[torch.Tensor]:
    """Real digits of each class (`[N_d, 1, 8, 8]` in [0, 1]), for realism and diversity references."""
    images, labels = real_digits()
    return [images[labels == d] for d in range(10)]


__all__ += ["decode", "encode", "real_by_digit", "split"]
