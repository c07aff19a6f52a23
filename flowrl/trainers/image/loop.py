"""LOOP: leave-one-out PPO (Gupta et al. 2025, arXiv:2503.00897).

k samples per prompt; each sample's baseline is the mean reward of the *other* k - 1 samples,
`A_i = r_i - mean_{j != i} r_j = k/(k-1) (r_i - mean)` (RLOO's baseline), and the policy is updated by
PPO-clip with importance sampling over several inner epochs, which a plain RLOO/REINFORCE update cannot do.
No public code exists; the choices below (what docs/algorithms/loop.md records): no std normalisation by
default (LOOP presents the baseline as a REINFORCE variance reduction; `advantage.std: group` turns it on),
the mean over steps, no KL, and Flow-GRPO's defaults for everything else (`FlowGRPOConfig`: the flow-SDE kernel,
the first 99% of the steps, clip 1e-4), with 2 inner epochs. LOOP itself ran DDPO's setting (SD1.5, DDIM):
`sampling.sampler: ddim` on a UNet family gives that kernel.
"""

from __future__ import annotations

import dataclasses

from flowrl.run.registry import register
from flowrl.sections import AdvantageConfig, BatchConfig
from flowrl.trainers.shared.flow_grpo import FlowGRPO, FlowGRPOConfig


@dataclasses.dataclass
class LOOPConfig(FlowGRPOConfig):
    batch: BatchConfig = dataclasses.field(default_factory=lambda: BatchConfig(inner_epochs=2))
    """PPO passes over each epoch's samples (the importance ratio is what makes several passes valid)."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(estimator="leave_one_out", std="none")
    )
    """The leave-one-out baseline, not divided by the group's std (`std: group` divides), not clipped."""

    def checks(self):
        return [
            *super().checks(),
            (
                self.advantage.estimator == "leave_one_out",
                f"loop is defined by its leave-one-out baseline; got advantage.estimator={self.advantage.estimator!r} "
                "(use flow_grpo for other estimators)",
            ),
            (
                self.reward_aggregation == "sum",
                "loop combines rewards by their weighted sum (reward_aggregation: sum)",
            ),
        ]


@register(
    "loop", description="LOOP: PPO-clip over several inner epochs with a leave-one-out baseline (arXiv:2503.00897)"
)
class LOOP(FlowGRPO):
    """LOOP; see the module docstring and `LOOPConfig`."""

    config_class = LOOPConfig
