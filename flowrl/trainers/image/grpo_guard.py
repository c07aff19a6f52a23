"""GRPO-Guard (Wang et al. 2025, arXiv:2510.22319): Flow-GRPO with a regulated importance ratio.

The per-step log-ratio of a flow-SDE policy is biased low (its mean is `-||dmu||^2 / (2 s^2)`) and its spread
scales with `1/s`, so PPO's upper clip rarely binds on low-noise steps and the policy over-optimises the proxy
reward. RatioNorm uses `s (l + ||dmu||^2 / (2 s^2))` instead (zero mean, step-independent spread under the old
policy), and each step's loss is divided by `|dt|` to equalise step gradients. Defaults follow the released
`config/grpo_guard.py`: clip 2e-6, per-group std, no KL, steps 0.99, weights 1/|dt|.
"""

from __future__ import annotations

import dataclasses

from flowrl.image import StepConfig
from flowrl.run.registry import register
from flowrl.sections import AdvantageConfig, ObjectiveConfig
from flowrl.trainers.shared.flow_grpo import FlowGRPO, FlowGRPOConfig


@dataclasses.dataclass
class GRPOGuardConfig(FlowGRPOConfig):
    objective: ObjectiveConfig = dataclasses.field(
        default_factory=lambda: ObjectiveConfig(name="grpo_guard", clip_eps_low=2e-6)
    )
    """The core's grpo_guard objective (PPO-clip on the RatioNorm-ed log-ratio), GRPO-Guard's clip range for
    SD3.5 at 512 px (4e-6 for PickScore), i.e. 65,536 latent elements; other sizes move it by
    `flowrl.core.ratios.clip_for_latent_size` (`eps * sqrt(65536 / D)`)."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(std="group", clip=5.0, unbiased=False)
    )
    """Per-group std (`global_std=False` in the released config)."""
    steps: StepConfig = dataclasses.field(default_factory=lambda: StepConfig(weighting="inv_dt"))
    """First 99% of the steps, each weighted 1/|dt|."""

    def __post_init__(self):
        super().__post_init__()
        if self.objective.name != "grpo_guard":
            raise ValueError(f"grpo_guard trains the grpo_guard objective; got objective.name={self.objective.name!r}")


@register("grpo_guard", description="GRPO-Guard: Flow-GRPO with RatioNorm and 1/|dt| step weights (arXiv:2510.22319)")
class GRPOGuard(FlowGRPO):
    """GRPO-Guard; see the module docstring. Rollouts keep each step's behaviour mean for RatioNorm."""

    config_class = GRPOGuardConfig
