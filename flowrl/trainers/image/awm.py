"""AWM: Advantage Weighted Matching (Xue et al. 2025, arXiv:2509.25050; code scxue/advantage_weighted_matching).

The current policy samples the epoch with any solver (CFG-free; flowrl's default the Euler ODE). Each sample
gets `num_draws` stored draws `(t, eps)`, one per stratum of the sampler's grid (`t_sampling: stratified`,
the code's `discrete_wo_init`), fixed for the epoch, and a per-draw "log-likelihood" from its flow-matching error

    l = mean_d (v_theta(x_t, t) - (eps - x1))^2,   log p_theta := -W(l, t),

with the code's weighting `ghuber` `W = (t / p) ((l + 1e-10)^p - 1e-10^p)`, p = 0.25 (or `uniform` `l`,
`t` `t l`, `t2` `t^2 l`). The core's PPO-clip then runs on `rho = exp(log p_theta - log p_old)` with
`log p_old` stored at the draws before the update (so rho is 1 at the behaviour weights, exactly) and the
advantage `A^ = clip(A, -5, 5) / 5` (`advantage_max` 1): with one optimizer step per epoch (AWM's recipe) the
gradient is `mean A^ grad W(l_theta, t)`, an advantage-weighted flow-matching loss; with `A^ = 1` and `uniform`
it is the pretraining loss on self-generated samples. `kl.beta` adds `beta ||v_theta - v_ref||^2` (the code's
KL to the LoRA-disabled base), and `kl_ema_beta` the code's "KL-EMA" (`ema_beta`, 1 in every official preset):
`kl_ema_beta mean_d (v_theta - v_ema)^2` to a lagged copy `theta_ema`, updated after each epoch as
`theta_ema <- d theta_ema + (1 - d) theta` with `d = min(kl_ema_decay_rate * step, kl_ema_decay_max)` (the code's
`kl_ema_decay_type: linear`, 0.001 and 0.3; `step` = optimizer steps so far, read after the epoch). The copy is
constant within an epoch, so its velocity is stored at the draws before the update, in the chunks training uses.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from flowrl.core import velocity_mse
from flowrl.core.copies import to_device
from flowrl.core.ratios import reduce_elements
from flowrl.core.terms import Terms
from flowrl.image import SamplingConfig
from flowrl.run.registry import register
from flowrl.run.state import EMA
from flowrl.sections import AdvantageConfig, HasKL, HasObjective, KLConfig, ObjectiveConfig
from flowrl.trainers.shared.matching import MatchingConfig, PerDrawAlgorithm


AWM_WEIGHTINGS = ("ghuber", "uniform", "t", "t2")


def awm_weight(loss: torch.Tensor, t: torch.Tensor, kind: str = "ghuber", power: float = 0.25) -> torch.Tensor:
    """`W(l, t)` `[n]` of per-draw flow-matching errors `loss [n]` at noise levels `t [n]` (AWM's `weighting`).

    `ghuber`: `(t / p) ((l + 1e-10)^p - (1e-10)^p)`: 0 at `l = 0`, increasing, `t l` at `p = 1`; `uniform`: `l`;
    `t`: `t l`; `t2`: `t^2 l`.
    """
    loss, t = loss.float(), to_device(t.float(), loss.device)
    if kind == "ghuber":
        # the 1e-10 keeps the gradient of l^p finite at l = 0 (the authors' constant)
        return (t / power) * ((loss + 1e-10) ** power - 1e-10**power)
    if kind == "uniform":
        return loss
    if kind == "t":
        return t * loss
    if kind == "t2":
        return t**2 * loss
    raise ValueError(f"weighting must be one of {', '.join(AWM_WEIGHTINGS)}, got {kind!r}")


@dataclasses.dataclass
class AWMConfig(HasObjective, HasKL, MatchingConfig):
    kl_forms: ClassVar[tuple[str, ...]] = ("w2",)

    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: SamplingConfig(sampler="ode", guidance_scale=1.0)
    )
    """CFG-free rollouts from the current policy (the code: SA-Solver, 14 steps; PickScore: a pure ODE)."""
    objective: ObjectiveConfig = dataclasses.field(
        default_factory=lambda: ObjectiveConfig(name="ppo", clip_eps_low=1.0)
    )
    """PPO-clip on the matching ratio with `clip_range` 1 (the code's: inactive at one step per epoch)."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(std="global", clip=5.0, unbiased=False)
    )
    """Per-prompt mean, one population std over the epoch, clipped to +-5."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=0.0, form="w2"))
    """`beta ||v_theta - v_ref||^2` (the code: 1e-3 GenEval, 3e-3 OCR, 1e-4 PickScore; off here)."""
    num_draws: int = 6
    """Training noise levels per sample (the code: 6 of 14 grid steps)."""
    t_sampling: Literal["uniform", "logit_normal", "grid", "stratified"] = "stratified"
    """One grid level per stratum of `[1, int(0.9 T)]` (the code's `discrete_wo_init`)."""
    weighting: Literal["ghuber", "uniform", "t", "t2"] = "ghuber"
    """`W(l, t)`, the log-likelihood surrogate `-log p` (the code: `ghuber`)."""
    ghuber_power: float = 0.25
    """p of `ghuber`."""
    advantage_max: float = 1.0
    """The advantage's range after clipping: `A^ = clip(A) * advantage_max / advantage.clip` (the code: 1)."""
    kl_ema_beta: float = 1.0
    """Weight of `mean_d (v_theta - v_ema)^2` to the lagged copy (the code's `ema_beta`: 1 in every preset; 0: off,
    no copy kept)."""
    kl_ema_decay_rate: float = 1e-3
    """u in the copy's decay `d = min(u step, kl_ema_decay_max)` (the code's linear type: 0.001)."""
    kl_ema_decay_max: float = 0.3
    """The cap of d (the code's `kl_ema_decay`: 0.3)."""

    def checks(self):
        return [
            *super().checks(),
            (self.ghuber_power > 0, "ghuber_power must be > 0"),
            (self.advantage_max > 0, "advantage_max must be > 0"),
            (self.kl_ema_beta >= 0 and self.kl_ema_decay_rate >= 0, "kl_ema_beta and kl_ema_decay_rate must be >= 0"),
            (0 <= self.kl_ema_decay_max < 1, "kl_ema_decay_max must be in [0, 1)"),
        ]


@register("awm", description="AWM: PPO on an advantage-weighted flow-matching likelihood (arXiv:2509.25050)")
class AWM(PerDrawAlgorithm):
    """AWM; see the module docstring and `AWMConfig`."""

    config_class = AWMConfig

    def build(self):
        super().build()
        params = [p for p in self.trained_module().parameters() if p.requires_grad]
        # the KL-EMA copy starts at theta (the code copies the LoRA into its "ema" adapter)
        self.kl_ema = EMA(params, 0.0, prefix="kl_ema") if self.config.kl_ema_beta > 0 else None

    def kl_ema_decay(self, step: int | None = None) -> float:
        """d at optimizer step `step` (default: the current one)."""
        c = self.config
        step = self.engine.optimizer_steps if step is None else step
        return min(c.kl_ema_decay_rate * step, c.kl_ema_decay_max)

    def advantages(self, collected, valid):
        """`A^ = clip(A, -c, c) * advantage_max / c` (c = `advantage.clip`; unclipped: `A * advantage_max`)."""
        adv, stats = super().advantages(collected, valid)
        clip = self.config.advantage.clip or 1.0
        return adv * (self.config.advantage_max / clip), stats

    def log_likelihood(self, v, x1, noises, taus) -> tuple[torch.Tensor, torch.Tensor]:
        """`(-W(l, t), l)` `[n]` each of velocities `v [n, ...]` at the draws."""
        c = self.config
        loss = reduce_elements((v.float() - (to_device(noises, x1.device).float() - x1)) ** 2, "mean")  # [n]
        return -awm_weight(loss, taus, c.weighting, c.ghuber_power), loss

    def prepare_draws(self, collected, advantages, epoch):
        """The epoch's draws and their behaviour log-likelihoods (under the weights before the update)."""
        rollout = collected.data
        draws = self.make_draws(rollout, collected.rows, epoch)
        old = torch.empty(draws.taus.shape)  # [B, N]
        for rows, j, logp in self.at_draws(
            dataclasses.replace(rollout, draws=draws),
            lambda part, x1, x_t, taus, noises, v: self.log_likelihood(v, x1, noises, taus)[0],
        ):
            old[rows, j] = logp.float().cpu()
        draws = dataclasses.replace(draws, old_log_probs=old)
        if self.kl_ema is None:
            return draws
        velocities = torch.empty((*draws.taus.shape, *rollout.latents.shape[2:]))  # [B, N, ...]
        with self.kl_ema.swapped():
            for rows, j, v in self.at_draws(dataclasses.replace(rollout, draws=draws), lambda *args: args[-1]):
                velocities[rows, j] = v.float().cpu()
        return dataclasses.replace(draws, old_velocity=velocities)

    def draw_terms(self, batch, rows, draw, *, x1, x_t, taus, noises, v):
        logp, loss = self.log_likelihood(v, x1, noises, taus)
        old = to_device(batch.draws.old_log_probs[rows, draw], logp.device)  # [n] -W at the behaviour weights
        terms = Terms(logp=logp, old_logp=old, logs={"fm_loss": loss.detach()})
        if self.kl_ema is not None:
            v_ema = to_device(batch.draws.old_velocity[rows, draw], v.device)  # [n, ...]
            ema_kl = velocity_mse(v, v_ema)  # [n]
            terms.penalty = self.config.kl_ema_beta * ema_kl
            terms.logs["ema_kl_loss"] = ema_kl.detach()
        return terms

    def finish(self, batch, epoch):
        """The KL-EMA copy's update after the epoch's steps (the code: after training, at `global_step`)."""
        if self.kl_ema is None:
            return {}
        d = self.kl_ema_decay()
        self.kl_ema.update(d)
        return {"awm/kl_ema_decay": d}

    def lagged_copies(self):
        return [self.kl_ema] if self.kl_ema is not None else []
