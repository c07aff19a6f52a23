"""A run's advantage estimator: the `advantage` config section applied to an epoch's per-reward scores.

One meaning for every trainer: the advantage of each sample before any learned baseline. Group, batch and
leave-one-out baselines come from this epoch's rewards; `per_prompt` keeps DDPO's running statistics and `sas`
DCPO's smoothed per-prompt statistics (their state goes into checkpoints); `raw` returns the reward itself for
trainers that subtract a learned baseline per transition or per sample (DPOK's value network, FIND's calibration
network).
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.config import AdvantageConfig
from flowrl.core import (
    PerPromptStatTracker,
    SmoothAdvantageStandardizer,
    batch_advantages,
    group_advantages,
    leave_one_out_advantages,
    raw_advantages,
)
from flowrl.rewards import combine_advantages


class AdvantageEstimator:
    """`estimator(rewards, group_ids, prompts) -> (advantages [N], stats)` for an `AdvantageConfig`.

    Args:
        config (`AdvantageConfig`): the estimator and its options.
        weights (`dict[str, float]`): each training reward's weight.
        aggregation (`str`): `sum` (advantages of the weighted reward sum) or `gdpo` (each reward's, weighted).
    """

    def __init__(self, config: AdvantageConfig, weights: dict[str, float], aggregation: str = "sum"):
        self.config, self.weights, self.aggregation = config, dict(weights), aggregation
        c = config
        eps = {} if c.eps is None else {"eps": c.eps}  # None: each estimator's own default
        self.tracker = None
        if c.estimator == "per_prompt":
            self.tracker = PerPromptStatTracker(c.buffer_size, c.min_count, clip=c.clip, **eps)
        elif c.estimator == "sas":
            self.tracker = SmoothAdvantageStandardizer(clip=c.clip)
        self.fn, self.kwargs = {
            "group": (group_advantages, {"std": c.std, "clip": c.clip, "unbiased": c.unbiased, **eps}),
            "batch": (batch_advantages, {"std": c.std, "clip": c.clip, "unbiased": c.unbiased, **eps}),
            "leave_one_out": (leave_one_out_advantages, {"normalize_std": c.std == "group", "clip": c.clip, **eps}),
            "raw": (raw_advantages, {"clip": c.clip}),
            "per_prompt": (None, {}),
            "sas": (None, {}),
        }[c.estimator]  # fmt: skip

    def __call__(self, rewards: dict[str, torch.Tensor], group_ids: torch.Tensor, prompts: list[str]):
        """Advantages of the valid samples: `rewards` `{name: [N]}`, `group_ids [N]`, the N prompt texts."""
        if self.tracker is not None:
            from flowrl.rewards.multi import weighted_sum

            return self.tracker(weighted_sum(rewards, self.weights, len(prompts)).float(), prompts)
        return combine_advantages(rewards, self.weights, group_ids, mode=self.aggregation, estimator=self.fn,
                                  **self.kwargs)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {} if self.tracker is None else {self.config.estimator: self.tracker.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tracker is not None:
            key = self.config.estimator
            if key not in state:
                what = "per-prompt tracker" if key == "per_prompt" else "smooth-standardisation"
                raise KeyError(f"the checkpoint has no {what} state (advantage.estimator={key})")
            self.tracker.load_state_dict(state[key])
