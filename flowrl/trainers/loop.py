"""LOOP: leave-one-out PPO (Gupta et al. 2025, arXiv:2503.00897).

k samples per prompt; each sample's baseline is the mean reward of the *other* k - 1 samples,
`A_i = r_i - mean_{j != i} r_j = k/(k-1) (r_i - mean)` (RLOO's baseline), and the policy is updated by
PPO-clip with importance sampling over several inner epochs, which a plain RLOO/REINFORCE update cannot do.
No public code exists; the choices below (what docs/algorithms/loop.md records): no std normalisation by
default (LOOP presents the baseline as a REINFORCE variance reduction; `adv_normalize_std` turns it on),
the mean over steps, no KL, DDPO's parity defaults for everything else.
"""

from __future__ import annotations

import dataclasses

from flowrl.core import leave_one_out_advantages
from flowrl.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer
from flowrl.trainers.registry import TRAINERS


@dataclasses.dataclass
class LOOPConfig(FlowGRPOConfig):
    trainer: str = "loop"
    inner_epochs: int = 2
    """PPO passes over each epoch's samples (the importance ratio is what makes several passes valid)."""
    adv_normalize_std: bool = False
    """Divide the leave-one-out advantage by the group's std (off: LOOP's REINFORCE-style baseline)."""
    adv_clip: float | None = None
    """Clip advantages to +-adv_clip (None: off)."""

    def __post_init__(self):
        super().__post_init__()
        if self.prompts.group_size < 2:
            raise ValueError("loop needs prompts.group_size >= 2: the leave-one-out baseline needs k - 1 others")
        if self.reward_aggregation != "sum":
            raise ValueError("loop combines rewards by their weighted sum (reward_aggregation: sum)")


@TRAINERS.register(
    "loop", description="LOOP: PPO-clip over several inner epochs with a leave-one-out baseline (arXiv:2503.00897)"
)
class LOOPTrainer(FlowGRPOTrainer):
    """LOOP; see the module docstring and `LOOPConfig`."""

    config_class = LOOPConfig

    def compute_advantages(self, rewards, group_ids, prompts=None):
        c = self.config
        return leave_one_out_advantages(self.combined_reward(rewards), group_ids,
                                        normalize_std=c.adv_normalize_std, eps=c.adv_eps, clip=c.adv_clip)  # fmt: skip
