"""FPO for images: Flow Policy Optimization's likelihood-free ratio over final latents (arXiv:2507.21053).

The image counterpart of the control trainer `fpo` (`flowrl.trainers.control.fpo`), on the same ratio
(`flowrl.policies.fpo`): the policy samples the epoch with any solver (CFG-free Euler ODE by default); each
final latent `x1` gets `num_draws` stored pairs `(tau_i, eps_i)` and the behaviour losses
`l_old_i = mean_d ||v_old(x_tau_i, tau_i) - (eps_i - x1)||^2`, computed before the update in the chunks a
training minibatch forwards in, so the ratio

    r = exp(mean_i l_old_i - mean_i l_theta_i)        (`ratio: mean`, FPO eq. 5-8: the core sees `[b, 1]`), or
    r_i = exp(clamp(l_old_i - l_theta_i, -3, 3))       (`ratio: per_draw`, FPO++: `[b, N]`, one advantage)

is exactly 1 before the first update, and the core's PPO-clip (or any objective: `ppo_spo` is FPO++'s
asymmetric trust region) bounds it. At the behaviour weights the gradient is the advantage-weighted
flow-matching gradient `A grad mean_i l_theta_i`. FPO has no KL term (the `kl` section is refused).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from flowrl.core.terms import Terms
from flowrl.image import SamplingConfig
from flowrl.policies.fpo import cfm_losses, fpo_log_ratio
from flowrl.run.registry import register
from flowrl.sections import AdvantageConfig, HasObjective, ObjectiveConfig
from flowrl.trainers.shared.matching import MatchingAlgorithm, MatchingConfig


@dataclasses.dataclass
class ImageFPOConfig(HasObjective, MatchingConfig):
    """FPO has no KL term: the config has no `kl` section."""

    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: SamplingConfig(sampler="ode", guidance_scale=1.0)
    )
    """CFG-free Euler ODE rollouts (FPO needs only final samples)."""
    objective: ObjectiveConfig = dataclasses.field(
        default_factory=lambda: ObjectiveConfig(name="ppo", clip_eps_low=0.2)
    )
    """PPO-clip 0.2 on FPO's ratio (FPO's grid world; `ppo_spo`: FPO++)."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=lambda: AdvantageConfig(std="group", clip=5.0))
    """Group z-scores, clipped to +-5."""
    num_draws: int = 8
    """Monte-Carlo pairs `(tau, eps)` per sample (FPO: 8)."""
    ratio: Literal["mean", "per_draw"] = "mean"
    """`mean`: one ratio per sample from the mean loss difference (FPO); `per_draw`: one per draw (FPO++)."""
    ratio_clamp: float | None = None
    """Clamp the log-ratio to `+-ratio_clamp` before `exp` (None: none for `mean`, 3 for `per_draw`)."""
    supervise: Literal["velocity", "eps"] = "velocity"
    """Regress the velocity, or FPO's `u_but_supervise_as_eps` (the velocity error times `(1 - tau)^2`)."""


@register("image_fpo", description="FPO for images: PPO on the flow-matching ratio of final samples")
class ImageFPO(MatchingAlgorithm):
    """Image FPO; see the module docstring and `ImageFPOConfig`."""

    config_class = ImageFPOConfig

    def losses(self, batch) -> torch.Tensor:
        """`[b, N]` per-draw flow-matching losses of the current policy at the batch's draws (one forward of
        `b * N` rows per `batch.micro_batch_size` samples, `DiffusionPolicy.velocity_fn`)."""
        draws = batch.draws
        velocity = self.policy.velocity_fn(batch, draws.taus.shape[1])
        x1 = batch.latents[:, -1]
        return cfm_losses(
            velocity, x1, draws.taus.to(x1.device), draws.noises.to(x1.device), supervise=self.config.supervise
        )

    def prepare_draws(self, collected, advantages, epoch):
        """The epoch's draws and the behaviour losses on them, in training-sized chunks."""
        draws = self.make_draws(collected.data, collected.rows, epoch)
        rollout = dataclasses.replace(collected.data, draws=draws)
        size = self.config.batch.micro_batch_size
        with torch.no_grad():
            old = torch.cat(
                [
                    self.losses(rollout.select(torch.arange(i, min(i + size, len(rollout))))).float().cpu()
                    for i in range(0, len(rollout), size)
                ]
            )
        return dataclasses.replace(draws, old_losses=old)

    def num_elements(self, rollout) -> int:
        return 1 if self.config.ratio == "mean" else self.config.num_draws

    def elements(self, batch, epoch):
        k = self.num_elements(batch.data)
        return torch.arange(k).expand(len(batch.data), -1), None

    def terms(self, batch, index):
        """FPO's log-ratio at the elements `index [b, c]` (the whole sample for `mean`, its draws for `per_draw`),
        with the old log-likelihood `-l_old` as `old_logp`."""
        c, batch = self.config, batch.data
        losses = self.losses(batch)  # [b, N]
        old_losses = batch.draws.old_losses.to(losses.device)
        log_ratio = fpo_log_ratio(losses, old_losses, mode=c.ratio, clamp=c.ratio_clamp)
        old = -old_losses.mean(-1, keepdim=True) if c.ratio == "mean" else -old_losses  # [b, 1] or [b, N]
        if log_ratio.ndim == 1:
            log_ratio = log_ratio[:, None]  # [b, 1]
        index = index.to(losses.device)
        return Terms(
            logp=(old + log_ratio).gather(1, index),
            old_logp=old.gather(1, index),
            logs={"fm_loss": losses.detach().mean(-1, keepdim=True).expand_as(index)},
        )
