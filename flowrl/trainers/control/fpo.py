"""FPO: Flow Policy Optimization for continuous control (McAllister et al. 2025, arXiv:2507.21053), and FPO++.

A flow policy (`flowrl.control.policies.FlowPolicy`: an MLP velocity field on the observation and flow time,
Euler sampling from noise) trained by PPO with FPO's likelihood-free ratio: at collection each action gets
`num_draws` pairs `(tau_i, eps_i)` and the behaviour policy's conditional flow-matching losses `l_old_i`
(`flowrl.policies.fpo`), and the update's ratio is `exp(mean_i l_old_i - mean_i l_theta_i)` per action
(`ratio: mean`, FPO eq. 5-8: the core sees `[b, 1]`) or `exp(clamp(l_old_i - l_theta_i))` per draw
(`ratio: per_draw`, FPO++ eq. 10: `[b, N]`, one shared advantage). FPO++'s asymmetric trust region is the
core's `ppo_spo` objective (`objective.name: ppo_spo`). Because the draws are stored and the old losses are
computed in training-sized chunks, the ratio is exactly 1 before the first update.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.control.config import ActorCriticConfig
from flowrl.control.policies import FlowPolicy
from flowrl.core.terms import Terms
from flowrl.policies.fpo import FPODraws, cfm_losses, fpo_log_ratio, sample_taus
from flowrl.run.registry import register
from flowrl.runtime import seeded
from flowrl.sections import ObjectiveConfig
from flowrl.trainers.shared.control import ActorCriticAlgorithm
from flowrl.trainers.shared.policies import FlowPolicyConfig


@dataclasses.dataclass
class FPOConfig(ActorCriticConfig):
    policy: FlowPolicyConfig = dataclasses.field(default_factory=FlowPolicyConfig)
    """The flow policy."""
    objective: ObjectiveConfig = dataclasses.field(
        default_factory=lambda: ObjectiveConfig(name="ppo", clip_eps_low=0.2)
    )
    """The clipped objective on FPO's ratio: clip 0.2 as FPO's PyTorch grid world, whose batches (~2k steps) are
    this loop's size (the JAX playground's 0.05 goes with 1024 x 32-transition minibatches); `ppo_spo`: FPO++'s
    asymmetric trust region."""
    num_draws: int = 8
    """Monte-Carlo pairs `(tau, eps)` per action (FPO playground: 8; grid world: 50)."""
    ratio: Literal["mean", "per_draw"] = "mean"
    """`mean`: one ratio per action from the mean loss difference (FPO); `per_draw`: one ratio per draw (FPO++)."""
    ratio_clamp: float | None = None
    """Clamp the log-ratio to `+-ratio_clamp` before `exp` (None: none for `mean`, 3 for `per_draw`, as FPO's code)."""
    supervise: Literal["velocity", "eps"] = "velocity"
    """Regress the velocity (FPO's grid world, the shipped configs), or `eps`: FPO's `u_but_supervise_as_eps`, the
    loss on the implied noise (the playground's default)."""
    t_sampling: Literal["uniform", "grid"] = "uniform"
    """The draws' flow times: `uniform` on (0, 1) (the grid world, the shipped configs) or `grid`: uniform over the
    sampler's step starts `1, 1 - 1/T, ..., 1/T` (the playground's `discretize_t_for_training`, its default)."""

    def checks(self):
        return [*super().checks(), (self.num_draws >= 1, "num_draws must be >= 1")]


@register("fpo", description="FPO: flow policies by PPO on a flow-matching ratio (arXiv:2507.21053)")
class FPO(ActorCriticAlgorithm):
    """FPO; see the module docstring and `FPOConfig`."""

    config_class = FPOConfig

    def build_actor(self, obs_dim: int, act_dim: int) -> FlowPolicy:
        return self.config.policy.build(obs_dim, act_dim)

    def losses(self, obs: torch.Tensor, actions: torch.Tensor, draws: FPODraws) -> torch.Tensor:
        """Per-draw flow-matching losses `[b, N]` of the current policy."""
        n = draws.taus.shape[1]
        fn = self.policy.actor.velocity.velocity_fn(obs, n)
        return cfm_losses(fn, actions, draws.taus, draws.noises, supervise=self.config.supervise)

    @torch.no_grad()
    def behaviour(self, rollout, rows, size):
        cfg = self.config
        generator = seeded(cfg.run.seed, self.epoch, 13, 0)
        n = cfg.num_draws
        # drawn for the whole epoch's rollout and indexed by row: a transition's draws are the same on any process
        grid = self.policy.actor.taus[:-1].cpu() if cfg.t_sampling == "grid" else None  # the Euler steps' start times
        taus = sample_taus((size, n), generator=generator, grid=grid)[rows]
        noises = torch.randn((size, n, rollout.actions.shape[1]), generator=generator)[rows]
        draws = FPODraws(taus, noises)
        old = torch.cat(
            [self.losses(rollout.obs[c], rollout.actions[c], draws.select(c)) for c in self.chunks(len(rollout))]
        )
        draws = FPODraws(taus, noises, old)
        log_probs = -old.mean(-1, keepdim=True) if cfg.ratio == "mean" else -old  # [B, 1] or [B, N]
        return log_probs, draws

    def policy_terms(self, batch, index: torch.Tensor) -> Terms:
        losses = self.losses(batch.obs, batch.actions, batch.draws)  # [b, N]
        log_ratio = fpo_log_ratio(
            losses, batch.draws.old_losses, mode=self.config.ratio, clamp=self.config.ratio_clamp
        )
        if log_ratio.ndim == 1:
            log_ratio = log_ratio[:, None]  # [b, 1]
        old = batch.log_probs.gather(1, index)
        return Terms(logp=old + log_ratio.gather(1, index), old_logp=old)
