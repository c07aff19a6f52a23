"""Diffusion-DPO (Wallace et al. 2023, arXiv:2311.12908) for flow models: online from the policy's own groups, or
offline from a preference file.

**Online** (Flow-Factory's `trainers/dpo.py`, Flow-GRPO's `scripts/train_sd3_dpo.py`): the current policy samples
the epoch's groups with any solver (CFG-free Euler ODE by default: Flow-Factory's example); in each group the sample
with the highest advantage becomes the chosen one and the sample with the lowest the rejected one (Flow-GRPO's
stat-tracker `dpo` mode, Flow-Factory's `_form_pairs_from_advantages`: one best/worst pair per group, not every pair).
A group whose rewards are all equal gives no pair (Flow-Factory then pairs a sample with itself, which has no
gradient; Flow-GRPO pairs samples 1 and 0 anyway). The group's other members do not train.

**Offline** (`preference_data`): the pairs of a JSONL file of `{"prompt", "chosen", "rejected"}` rows with PNG
paths (`flowrl.image.preferences`; the digits example: `python -m flowrl.digits.preferences DIR`),
`prompts.prompts_per_epoch` pairs per epoch, drawn without replacement; the policy samples only for evaluation.

Each pair trains on `num_draws` draws `(t, eps)` shared by its two images (`flowrl.trainers.shared.preference`; t
logit-normal by default, as both codes draw it) with the flow-matching form of the paper's eq. 14 (`T omega(lambda_t)`
folded into beta, as both codes do):

    L = -log sigmoid(-(beta / 2) [(l_theta(x_w) - l_ref(x_w)) - (l_theta(x_l) - l_ref(x_l))]),

`l = mean_d (v(x_t, t) - (eps - x1))^2` under the trained network and under the reference (the base model: the
network with its LoRA disabled, or a frozen copy under full fine-tuning), averaged over pairs and draws
(`flowrl.core.preference.diffusion_dpo`). At `theta = ref` it is log 2 for every pair.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from flowrl.image import SamplingConfig
from flowrl.run.registry import register
from flowrl.trainers.shared.matching import MatchingConfig
from flowrl.trainers.shared.preference import PreferenceAlgorithm


@dataclasses.dataclass
class DiffusionDPOConfig(MatchingConfig):
    absent: ClassVar[dict[str, str]] = {
        "objective": "its loss is the Diffusion-DPO objective (flowrl.core.preference): set beta",
        "kl": "beta is its KL to the reference; it has no other regulariser",
    }

    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: SamplingConfig(sampler="ode", guidance_scale=1.0)
    )
    """The policy's rollouts: CFG-free Euler ODE (Flow-Factory's DPO example: ODE, guidance 1; Flow-GRPO: its SDE at
    noise 0.7 and CFG 4.5, from the reference adapter)."""
    num_draws: int = 1
    """Draws `(t, eps)` per pair and epoch (Flow-Factory: `num_train_timesteps` 1; Flow-GRPO: `int(0.99 T)` = 39)."""
    t_sampling: Literal["uniform", "logit_normal", "grid", "stratified"] = "logit_normal"
    """Noise levels of the draws: logit-normal (0, 1) as both codes draw them (`flowrl.trainers.shared.matching`)."""
    beta: float = 100.0
    """beta of the loss (Flow-GRPO `config/dpo.py` and Flow-Factory's example: 100; Flow-Factory's dataclass
    default: 2000)."""
    preference_data: str | None = None
    """A preference JSONL file (`flowrl.image.preferences`): train offline on its pairs instead of the policy's
    samples (`prompts.group_size` must be 2); None: online."""

    def checks(self):
        return [
            *super().checks(),
            (self.beta > 0, f"beta must be > 0, got {self.beta}"),
            (
                self.preference_data is None or self.prompts.group_size == 2,
                "preference_data: each epoch's rows are pairs (chosen, rejected): set prompts.group_size to 2",
            ),
        ]


def best_and_worst(advantages: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`[N]`: +1 for each group's highest-advantage valid sample, -1 for its lowest, 0 elsewhere (ties: the first);
    a group with fewer than two valid samples or no spread has no pair."""
    out = torch.zeros_like(advantages, dtype=torch.float32)
    for group in groups[valid].unique().tolist():
        members = ((groups == group) & valid).nonzero().flatten()
        values = advantages[members]
        if len(members) < 2 or not values.max() > values.min():
            continue
        out[members[values.argmax()]] = 1.0
        out[members[values.argmin()]] = -1.0
    return out


@register(
    "diffusion_dpo", description="Diffusion-DPO: online best/worst pairs or offline preference data (arXiv:2311.12908)"
)
class DiffusionDPO(PreferenceAlgorithm):
    """Diffusion-DPO; see the module docstring and `DiffusionDPOConfig`."""

    config_class = DiffusionDPOConfig
    preference = "diffusion_dpo"

    @property
    def offline(self) -> bool:
        return self.config.preference_data is not None

    def collector(self):
        """The policy's groups (online), or the preference file's pairs (offline)."""
        if not self.offline:
            return super().collector()
        from flowrl.image.preferences import PreferenceCollector, load_preferences

        c = self.config
        return PreferenceCollector(
            policy=self.policy,
            pairs=load_preferences(c.preference_data),
            processes=self.processes,
            pairs_per_epoch=c.prompts.prompts_per_epoch,
            seed=c.run.seed,
            num_steps=c.sampling.num_steps,
            height=c.sampling.height,
            width=c.sampling.width,
        )

    def group_keys(self, texts):
        """Online: the prompt; offline: the pair (rows `2p` and `2p + 1`), whatever its prompt."""
        return [i // 2 for i in range(len(texts))] if self.offline else texts

    def advantages(self, collected, valid):
        """+1 for the chosen and -1 for the rejected sample of each pair, 0 for the rest."""
        if self.offline:
            return collected.total.float() * 2 - 1, {}  # labels 1 (chosen) and 0 (rejected)
        advantages, stats = super().advantages(collected, valid)
        pairs = best_and_worst(advantages, collected.group_ids, valid)
        chosen, rejected = pairs > 0, pairs < 0
        stats = {**stats, "dpo_pairs": int(chosen.sum())}
        if chosen.any():  # how far apart the pairs' rewards are (Flow-Factory's dpo_adv_margin_mean, in rewards)
            stats["dpo_reward_margin"] = float(collected.total[chosen].mean() - collected.total[rejected].mean())
        return pairs, stats

    def prepare(self, collected, advantages, trainable, epoch):
        """Only the pairs train."""
        return super().prepare(collected, advantages, trainable & (advantages != 0), epoch)
