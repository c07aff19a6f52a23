"""Denoising-MDP PPO for flow policies: DPPO (Ren et al. 2024, arXiv:2409.00588) on the shared core.

The flow policy of `fpo` samples its action through the K steps of a stochastic kernel of `flowrl.policies.sde`
(`policy.sampler`, `policy.noise_level`), so each step `a^k -> a^{k+1}` is a Gaussian transition with a
log-probability; the chain is stored and each minibatch re-scores its K steps in one network call: the core
sees `[b, K]` per-step log-probabilities, one ratio per (env step, denoising step), every step sharing the env
step's GAE advantage, optionally discounted along the chain by `step_discount` (DPPO's gamma_denoising: the
final step weighs 1, step k from the end `step_discount^k`). DPPO's defaults for training from scratch
(HalfCheetah): all K steps trained, clip 0.1, log-probs averaged over action dimensions, step discount 1, and its
code's guards (`policy.min_std` 0.1, `policy.noise_clip` 3, `policy.log_prob_clamp` [-5, 2]; `DPPOGuards`).
Evaluation integrates the ODE from zero noise.

What this is: DPPO's objective and guards on a flow-matching policy's Euler chain made stochastic by a flow
kernel (`dance_sde`, step std `eta sqrt(1/K)` = 0.095 at eta 0.3 and K 10, floored at 0.1), the same denoising MDP
as FPO's DPPO baseline; DPPO itself fine-tunes DDPM/DDIM noise-prediction policies, whose steps are the DDPM
posterior Gaussians. The ratio, clip, advantage and guards are DPPO's; the step kernel is a flow's.
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl.control.config import ActorCriticConfig
from flowrl.core.terms import Terms
from flowrl.run.registry import register
from flowrl.sections import ObjectiveConfig
from flowrl.trainers.shared.control import ActorCriticAlgorithm
from flowrl.trainers.shared.policies import FlowPolicyConfig


@dataclasses.dataclass
class DPPOConfig(ActorCriticConfig):
    policy: FlowPolicyConfig = dataclasses.field(
        default_factory=lambda: FlowPolicyConfig(min_std=0.1, noise_clip=3.0, log_prob_clamp=(-5.0, 2.0))
    )
    """The flow policy and its denoising kernel, with DPPO's guards (min std 0.1, noise clip 3, log-prob [-5, 2])."""
    objective: ObjectiveConfig = dataclasses.field(
        default_factory=lambda: ObjectiveConfig(name="ppo", clip_eps_low=0.1)
    )
    """The clipped objective on the per-step ratios (DPPO from scratch: clip 0.1)."""
    step_discount: float = 1.0
    """DPPO's gamma_denoising: step weights `step_discount^(K - 1 - k)` (1: all equal)."""

    def checks(self):
        return [*super().checks(), (0 < self.step_discount <= 1, "step_discount must lie in (0, 1]")]


@register("dppo", description="denoising-MDP PPO with DPPO's objective and guards on a flow kernel (arXiv:2409.00588)")
class DPPO(ActorCriticAlgorithm):
    """Denoising-MDP PPO; see the module docstring and `DPPOConfig`."""

    config_class = DPPOConfig
    keeps_chain = True

    def build_actor(self, obs_dim: int, act_dim: int):
        return self.config.policy.build(obs_dim, act_dim)

    @torch.no_grad()
    def behaviour(self, rollout, rows, size):
        actor, k = self.policy.actor, self.policy.actor.num_steps
        parts = [
            actor.step_log_probs(rollout.obs[c], rollout.chain[c], torch.arange(k).expand(len(c), k))
            for c in self.chunks(len(rollout))
        ]
        return torch.cat(parts), None  # [B, K]

    def policy_terms(self, batch, index: torch.Tensor) -> Terms:
        k = self.policy.actor.num_steps
        logp = self.policy.actor.step_log_probs(batch.obs, batch.chain, index)  # [b, c]
        weight = None
        if self.config.step_discount != 1.0:
            weight = self.config.step_discount ** (k - 1 - index).float()
        return Terms(logp=logp, old_logp=batch.log_probs.gather(1, index), weight=weight)
