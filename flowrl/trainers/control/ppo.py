"""Gaussian PPO for continuous control (Schulman et al. 2017, arXiv:1707.06347), the baseline of FPO and DPPO.

A state-independent diagonal Gaussian on an MLP mean (SB3's and CleanRL's continuous PPO: 64-64 tanh, orthogonal
init with a 0.01 action head, log-std 0), the shared control loop (GAE, per-minibatch advantage whitening, MSE
value loss without 1/2, one Adam with eps 1e-5 and a 0.5 gradient-norm clip), and the core's clipped
objectives on `[b, 1]` log-probabilities summed over action dimensions. The defaults are SB3's, so the two
libraries can be compared setting for setting (`benchmarks/control_bench.py`). With one inner epoch, one
mini-batch of the whole rollout (`batch.mini_batch_size: null`), `advantage.lam` 1, no advantage whitening and
RMSprop this update is A2C's (Huang et al. 2022, arXiv:2205.09123; `tests/control/test_control.py`).
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl.control.config import ActorCriticConfig
from flowrl.control.policies import GaussianPolicy
from flowrl.core.terms import Terms
from flowrl.run.registry import register
from flowrl.sections import ObjectiveConfig
from flowrl.trainers.shared.control import ActorCriticAlgorithm
from flowrl.trainers.shared.policies import GaussianPolicyConfig


@dataclasses.dataclass
class PPOConfig(ActorCriticConfig):
    policy: GaussianPolicyConfig = dataclasses.field(default_factory=GaussianPolicyConfig)
    """The Gaussian policy."""
    objective: ObjectiveConfig = dataclasses.field(default_factory=lambda: ObjectiveConfig(name="ppo"))
    """The clipped objective (PPO's clip 0.2 by default; any registered objective works)."""
    ent_coef: float = 0.0
    """Entropy bonus: `-ent_coef * entropy` of the Gaussian per transition (SB3: 0)."""

    def checks(self):
        return [*super().checks(), (self.ent_coef >= 0, "ent_coef must be >= 0")]


@register("ppo", description="Gaussian PPO for continuous control on Gymnasium (arXiv:1707.06347)")
class PPO(ActorCriticAlgorithm):
    """Gaussian PPO; see the module docstring and `PPOConfig`."""

    config_class = PPOConfig

    def build_actor(self, obs_dim: int, act_dim: int) -> GaussianPolicy:
        return self.config.policy.build(obs_dim, act_dim)

    @torch.no_grad()
    def behaviour(self, rollout, rows, size):
        actor = self.policy.actor
        parts = [actor.log_prob(rollout.obs[c], rollout.actions[c]) for c in self.chunks(len(rollout))]
        return torch.cat(parts)[:, None], None  # [B, 1]

    def policy_terms(self, batch, index: torch.Tensor) -> Terms:
        actor = self.policy.actor
        logp = actor.log_prob(batch.obs, batch.actions)[:, None]  # [b, 1]
        penalty = None
        if self.config.ent_coef:
            penalty = -self.config.ent_coef * actor.entropy(batch.obs)[:, None]
        return Terms(logp=logp, old_logp=batch.log_probs.gather(1, index), penalty=penalty)
