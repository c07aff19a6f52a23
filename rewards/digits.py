"""Rewards and gold metrics of the digits world (`flowrl.digits`).

`digits_alignment` is what the trainer optimises: the reward classifier's probability of the prompted digit
(the GenEval analogue). The gold metrics are never optimised: `digits_gold` asks an independently trained
classifier (another architecture, the other half of the data) whether the prompted digit is there,
`digits_realism` measures how far samples drift from real digits of that class.
"""

from __future__ import annotations

import torch

from flowrl.rewards import register
from flowrl.rewards.base import Reward


class _DigitsReward(Reward):
    """Shared plumbing: the cached classifiers (trained on first use) and prompt -> digit parsing.

    Args:
        classifiers (`DigitClassifiers`, *optional*): defaults to the cached ones of `seed`.
        seed (`int`, defaults to 0): which classifiers (the digits world's build seed).
    """

    def __init__(self, classifiers=None, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        if classifiers is None:
            from flowrl.digits import BuildConfig, load_classifiers

            classifiers = load_classifiers(BuildConfig(seed=seed))
        self.classifiers = classifiers

    def check_prompts(self, prompts) -> None:
        """Raise `ValueError` naming the first prompt that names no single digit (before any training)."""
        from flowrl.digits import digit_of

        for prompt in prompts:
            digit_of(str(prompt))

    def _targets(self, prompts) -> torch.Tensor:
        from flowrl.digits import digit_of

        return torch.tensor([digit_of(p) for p in prompts], device=self.device)

    @staticmethod
    def _pixels(images):
        from flowrl.digits import to_pixels

        return to_pixels(images)


@register("digits_alignment")
class DigitsAlignment(_DigitsReward):
    """Digits world: reward classifier's probability of the prompted digit (needs: the digits world, built offline)."""

    differentiable = True

    def score(self, images, prompts, **metadata):
        logits = self.classifiers.reward.to(self.device)(self._pixels(images))
        return logits.softmax(-1).gather(1, self._targets(prompts)[:, None])[:, 0]


@register("digits_accuracy")
class DigitsAccuracy(_DigitsReward):
    """Digits world: 1 if the reward classifier's top class is the prompted digit (the alignment metric)."""

    def score(self, images, prompts, **metadata):
        logits = self.classifiers.reward.to(self.device)(self._pixels(images))
        return (logits.argmax(-1) == self._targets(prompts)).float()


@register("digits_gold")
class DigitsGold(_DigitsReward):
    """Digits world gold metric: 1 if an independent MLP classifier (other data, never optimised) sees the digit."""

    def score(self, images, prompts, **metadata):
        logits = self.classifiers.gold.to(self.device)(self._pixels(images))
        return (logits.argmax(-1) == self._targets(prompts)).float()


@register("digits_realism")
class DigitsRealism(_DigitsReward):
    """Digits world gold metric: nearest-real-digit distance in the gold classifier's features / real-data baseline.

    About 1 for samples as close to real digits of their class as held-out real digits are; larger values mean
    samples drift away from the real-digit distribution (lower is better).
    """

    def __init__(self, classifiers=None, seed: int = 0, **kwargs):
        super().__init__(classifiers, seed, **kwargs)
        from flowrl.digits import real_digits, split

        images, labels = real_digits()
        part_a, part_b = split(self.classifiers.meta["seed"])
        features = self._features(images)
        self.reference = [features[part_a][labels[part_a] == d] for d in range(10)]
        # baseline: distance of held-out real digits (part b) to the reference set (part a), per class
        self.baseline = torch.stack(
            [self._nn_distance(features[part_b][labels[part_b] == d], self.reference[d]).mean() for d in range(10)]
        )

    def _features(self, pixels):
        return self.classifiers.gold.features(pixels)

    @staticmethod
    def _nn_distance(x, reference):
        return torch.cdist(x, reference).min(dim=1).values

    def score(self, images, prompts, **metadata):
        features = self._features(self._pixels(images).cpu())
        targets = self._targets(prompts).cpu()
        out = torch.empty(len(prompts))
        for d in targets.unique().tolist():  # a loop over the (at most 10) classes present
            sel = targets == d
            out[sel] = self._nn_distance(features[sel], self.reference[d]) / self.baseline[d]
        return out


@register("digits_hackable")
class DigitsHackable(_DigitsReward):
    """Digits world, a proxy made to be over-optimised: the reward classifier's raw logit margin plus paid ink.

    `logit_weight * (z_y - logsumexp_{j != y} z_j) + ink_weight * mean(pixels)`: the margin of the prompted digit
    `y` keeps paying after the digit is recognised (where `digits_alignment`'s probability saturates at 1), and the
    ink term pays for thicker, brighter strokes whatever they draw. Both push samples off the real-digit
    distribution, so the gold metrics (`digits_gold`, `digits_realism`) eventually fall while this rises: the
    over-optimisation study's reward (docs/studies.md).

    Args:
        logit_weight (`float`, defaults to 0.1): weight of the logit margin.
        ink_weight (`float`, defaults to 3.0): weight of the mean pixel intensity in [0, 1] (at 3, Flow-GRPO on the
            digits loses realism from about epoch 12 and gold accuracy by epoch 40).
    """

    differentiable = True

    def __init__(self, classifiers=None, seed: int = 0, logit_weight: float = 0.1, ink_weight: float = 3.0, **kwargs):
        super().__init__(classifiers, seed, **kwargs)
        self.logit_weight, self.ink_weight = float(logit_weight), float(ink_weight)

    def score(self, images, prompts, **metadata):
        pixels = self._pixels(images)
        logits = self.classifiers.reward.to(self.device)(pixels)  # [B, 10]
        target = self._targets(prompts)[:, None]  # [B, 1]
        chosen = logits.gather(1, target)[:, 0]
        others = logits.scatter(1, target, float("-inf")).logsumexp(-1)  # the prompted class left out
        return self.logit_weight * (chosen - others) + self.ink_weight * pixels.flatten(1).mean(-1)
