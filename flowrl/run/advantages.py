"""A run's advantage estimator: the `advantage` config section applied to an epoch's per-reward scores.

One meaning for every trainer: the advantage of each sample before any learned baseline. The estimator is looked up
in the core's registry (`flowrl.core.ADVANTAGES`, or a `package.module:attribute` of your own) and given the options
of the section its signature takes. A function estimator (`group`, `batch`, `leave_one_out`, `raw`) sees this
epoch's rewards; a class (`per_prompt`: DDPO's running statistics, `sas`: DCPO's smoothed per-prompt statistics)
keeps state that goes into checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.core import ADVANTAGES
from flowrl.rewards import combine_advantages
from flowrl.rewards.multi import weighted_sum
from flowrl.sections import AdvantageConfig, PromptedConfig


class AdvantageEstimator:
    """`estimator(rewards, group_ids, prompts) -> (advantages [N], stats)` for an `AdvantageConfig`.

    Args:
        config (`AdvantageConfig`): the estimator and its options.
        weights (`dict[str, float]`): each training reward's weight.
        aggregation (`str`): `sum` (advantages of the weighted reward sum) or `gdpo` (each reward's, weighted).
    """

    def __init__(self, config: AdvantageConfig, weights: dict[str, float], aggregation: str = "sum"):
        self.config, self.weights, self.aggregation = config, dict(weights), aggregation
        target = ADVANTAGES.resolve(config.estimator)
        self.tracker = target(**config.options(target)) if isinstance(target, type) else None
        self.fn, self.kwargs = (None, {}) if self.tracker is not None else (target, config.options(target))

    @classmethod
    def of(cls, config) -> AdvantageEstimator | None:
        """The estimator of a trainer config with prompt groups and rewards (None for control: GAE)."""
        if not isinstance(config, PromptedConfig):
            return None
        weights = {spec.name: spec.weight for spec in config.rewards}
        return cls(config.advantage, weights, config.reward_aggregation)

    def __call__(self, rewards: dict[str, torch.Tensor], group_ids: torch.Tensor, prompts: list[str]):
        """Advantages of the valid samples: `rewards` `{name: [N]}`, `group_ids [N]`, the N prompt texts."""
        if self.tracker is not None:
            return self.tracker(weighted_sum(rewards, self.weights, len(prompts)).float(), prompts)
        return combine_advantages(
            rewards, self.weights, group_ids, mode=self.aggregation, estimator=self.fn, **self.kwargs
        )

    def state_dict(self) -> dict[str, Any]:
        return {} if self.tracker is None else {self.config.estimator: self.tracker.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tracker is not None:
            key = self.config.estimator
            if key not in state:
                what = "per-prompt tracker" if key == "per_prompt" else "smooth-standardisation"
                raise KeyError(f"the checkpoint has no {what} state (advantage.estimator={key})")
            self.tracker.load_state_dict(state[key])
