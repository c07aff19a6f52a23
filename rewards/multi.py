"""Several rewards at once: score each once per batch, combine them as scores or as advantages.

`MultiReward({"pickscore": 1.0, "aesthetic": 0.2}, aesthetic={"head": PATH})` builds each reward once and
returns the weighted sum `sum_k w_k r_k` (Flow-GRPO's `multi_score`), with the per-reward scores available
from `evaluate`. A weight of 0 scores a reward for logging only (its NaNs do not reach the total).

`combine_advantages(scores, weights, group_ids, mode)` turns per-reward scores into one advantage per sample:

- `"sum"` (Flow-GRPO, Flow-Factory `sum`): group advantages of the weighted raw sum `sum_k w_k r_k`.
- `"gdpo"` (Flow-Factory `gdpo`; DanceGRPO and MixGRPO also normalise each reward separately): group-normalise
  each reward, take the weighted sum `sum_k w_k A_k`, then re-normalise over the whole batch
  `(A - mean(A)) / (std(A) + eps)` (population std). A reward with a large spread can no longer drown the
  others, and the weights mean "relative importance" whatever each reward's scale.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flowrl.rewards import check_output, get, register
from flowrl.rewards.base import Reward


@dataclass
class MultiRewardOutput:
    """`total` `[B]` = `sum_k w_k scores[k]` over the non-zero weights; `scores` per reward `[B]` (float32, CPU)."""

    total: torch.Tensor
    scores: dict[str, torch.Tensor]


@register("multi")
class MultiReward(Reward):
    """Weighted sum of several rewards, each scored once per batch (needs: what each listed reward needs).

    Args:
        weights (`dict[str, float]`): reward name -> weight. The name is a registered reward, a dotted path
            `package.module:attribute`, or any label whose kwargs give the reward as `name`.
        rewards (`dict[str, Callable]`, *optional*): already built rewards for some of the names (shared
            instances, tests); the others are built with `rewards.get`.
        **reward_kwargs: per-reward constructor kwargs, keyed by the name in `weights`, e.g.
            `aesthetic={"head": "/models/sac+logos+ava1-l14-linearMSE.pth"}`; the key `name` picks the reward
            to build, so one reward can appear twice: `clip_b={"name": "clip_score", "model": ...}`.
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        rewards: Mapping[str, Callable[..., Any]] | None = None,
        **reward_kwargs: dict[str, Any],
    ):
        super().__init__()
        if not weights:
            raise ValueError("MultiReward needs at least one reward in `weights`")
        unknown = sorted(set(reward_kwargs) - set(weights))
        if unknown:
            raise ValueError(f"MultiReward got kwargs for {unknown}, which are not in weights {sorted(weights)}")
        self.weights = {name: float(w) for name, w in weights.items()}
        built = dict(rewards or {})
        self.rewards: dict[str, Callable[..., Any]] = {}
        for label in self.weights:
            if label in built:
                self.rewards[label] = built[label]
                continue
            kwargs = dict(reward_kwargs.get(label) or {})
            self.rewards[label] = get(kwargs.pop("name", label), **kwargs)
        active = [self.rewards[k] for k, w in self.weights.items() if w != 0]
        self.differentiable = all(isinstance(r, Reward) and r.differentiable for r in active)

    def evaluate(self, images: torch.Tensor, prompts, **metadata) -> MultiRewardOutput:
        """Every reward's scores and the weighted total, each reward called once on the whole batch."""
        prompts = list(prompts)
        scores = {
            label: check_output(label, reward(images, prompts, **metadata), len(prompts))
            for label, reward in self.rewards.items()
        }
        return MultiRewardOutput(total=weighted_sum(scores, self.weights, len(prompts)), scores=scores)

    def __call__(self, images: torch.Tensor, prompts, **metadata) -> torch.Tensor:
        return self.evaluate(images, prompts, **metadata).total

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        """Differentiable weighted sum of the rewards' raw `score`s (all weighted rewards must be differentiable)."""
        if not self.differentiable:
            raise TypeError("MultiReward.score needs every weighted reward to be a differentiable Reward")
        parts = [w * self.rewards[k].score(images, prompts, **metadata) for k, w in self.weights.items() if w != 0]
        return torch.stack([p.float().to(parts[0].device) for p in parts]).sum(0)


def weighted_sum(scores: Mapping[str, torch.Tensor], weights: Mapping[str, float], size: int) -> torch.Tensor:
    """`sum_k w_k scores[k]` over the non-zero weights (zero-weight rewards are logged only)."""
    total = torch.zeros(size, dtype=torch.float32)
    for name, weight in weights.items():
        if weight != 0:
            total = total + weight * torch.as_tensor(scores[name], dtype=torch.float32).cpu()
    return total


def combine_advantages(
    per_reward_scores: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_ids,
    mode: str = "sum",
    estimator: Callable[..., tuple[torch.Tensor, dict[str, float]]] | None = None,
    **group_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One advantage per sample from several rewards' scores (`mode="sum"` or `"gdpo"`, see the module doc).

    Args:
        per_reward_scores (`dict[str, Tensor]`): reward name -> `[N]` finite scores.
        weights (`dict[str, float]`): reward name -> weight (zero-weight rewards are ignored).
        group_ids: `[N]` group of each sample (prompt index or prompt string).
        mode (`str`, defaults to `"sum"`): `"sum"` or `"gdpo"`.
        estimator (`Callable`, *optional*): `estimator(rewards [N], group_ids, **group_kwargs) -> (adv, stats)`,
            one of `flowrl.core.ADVANTAGES`; defaults to `flowrl.core.group_advantages`.
        **group_kwargs: passed to the estimator (`std`, `eps`, `unbiased`, `clip` for the group one). In `gdpo`
            mode they apply to each reward's advantages, `eps` also to the batch re-normalisation, and `clip`
            to the final advantages.

    Returns:
        `(advantages[N], stats)`; stats hold the group statistics and, for `gdpo`, each reward's
        `zero_std_frac` and the batch mean/std that were removed.
    """
    from flowrl.core import group_advantages

    estimator = estimator or group_advantages
    active = {name: float(w) for name, w in weights.items() if w != 0}
    if not active:
        raise ValueError("combine_advantages needs at least one non-zero weight")
    missing = sorted(set(active) - set(per_reward_scores))
    if missing:
        raise ValueError(f"combine_advantages: no scores for {missing} (have {sorted(per_reward_scores)})")
    scores = {name: torch.as_tensor(per_reward_scores[name]).detach().float().cpu() for name in active}
    sizes = {name: tuple(s.shape) for name, s in scores.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"combine_advantages: reward scores have different shapes {sizes}")
    if mode == "sum":
        total = sum(w * scores[name] for name, w in active.items())
        return estimator(total, group_ids, **group_kwargs)
    if mode != "gdpo":
        raise ValueError(f"combine_advantages: mode must be 'sum' or 'gdpo', got {mode!r}")
    clip = group_kwargs.pop("clip", None)
    eps = group_kwargs.get("eps", 1e-4)
    combined = torch.zeros_like(next(iter(scores.values())))
    stats: dict[str, float] = {}
    for name, w in active.items():
        adv, reward_stats = estimator(scores[name], group_ids, **group_kwargs)
        combined = combined + w * adv
        stats[f"{name}/zero_std_frac"] = reward_stats["zero_std_frac"]
    mean, std = combined.mean(), combined.std(unbiased=False)
    adv = (combined - mean) / (std + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    stats.update(
        num_groups=reward_stats["num_groups"],
        batch_mean=float(mean),
        batch_std=float(std),
        adv_mean=float(adv.mean()),
        adv_std=float(adv.std(unbiased=False)),
        adv_abs_max=float(adv.abs().max()),
    )
    return adv, stats
