"""DGPO: Direct Group Preference Optimization (Luo, Hu and Tang 2025, arXiv:2510.08425; code Luo-Yihong/DGPO
`scripts/train_sd3_dgpo.py`, `config/dgpo.py`; Flow-Factory's `trainers/dgpo.py`).

A group-level DPO that needs no stochastic policy: the current policy samples each prompt's group with any solver
(CFG-free Euler ODE by default; the code: DPM-Solver, 10 steps), rewards give group-relative advantages `A`
(per-prompt mean and std, clipped to +-5), and the group is trained as one preference: its samples with `A > 0`
against those with `A < 0`, each weighted by `|A|`. Each group trains on `num_draws` draws whose times are shared
by the whole batch (distinct levels among the sampler's first `trunc_steps + 1` grid levels, the high-noise end:
the code's `trunc_steps` and `num_train_timesteps`) and whose noise is shared within the group (`use_shared_noise`).
With the implicit reward `x = l_ref - l_theta` of each draw's flow-matching error `l = mean_d (v - (eps - x1))^2`:

    L = (1 / beta) -log sigmoid((beta / n_g) sum_{i in g} A_i x_i)      per (group, draw),

whose gradient `sigmoid(-z_g) A_i grad l_theta(i)` is the one the code back-propagates
(`sg(sigmoid(s_g)) A_i dsm_i`, `s_g = (beta / G) sum_i A_i (dsm_i - dsm_ref_i)`; `flowrl.core.preference.dgpo`).

A lagged copy `theta_old` (the code's `ema_ref`) gives the **DSM clip** (`dsm_clip`, the code's `clip_dsm` with
`clip_range`): a sample's error stops passing gradient once `r = exp(l_old - l_theta)` left `[1 - eps, 1 + eps]` in
its advantage's direction; its errors at the draws are stored before the update. It is updated after each epoch,
`theta_old <- d theta_old + (1 - d) theta`, `d = min(old_decay_rate (S - 1), old_decay_max)` with `S` the optimizer
steps taken so far (the code updates it after every optimizer step at its step count; with its one step per epoch
that is the same), and samples the rollouts once more than `old_sampling_after` optimizer steps were taken (the
code's `switch_ema_ref`). `ema_reference` makes it the preference's reference too (the code's `use_ema_ref`);
`kl.beta` adds `beta ||v_theta - v_ref||^2` to the base model, whose velocity takes CFG `reference_guidance` (the
code's `kl_cfg`; also the DGPO reference's).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from flowrl.core import velocity_mse
from flowrl.image import SamplingConfig
from flowrl.run.registry import register
from flowrl.run.state import EMA
from flowrl.sections import AdvantageConfig, HasKL, KLConfig
from flowrl.trainers.shared.matching import MatchingConfig
from flowrl.trainers.shared.preference import PreferenceAlgorithm


@dataclasses.dataclass
class DGPOConfig(HasKL, MatchingConfig):
    kl_forms: ClassVar[tuple[str, ...]] = ("w2",)
    absent: ClassVar[dict[str, str]] = {
        "objective": "its loss is the DGPO objective (flowrl.core.preference): set beta and dsm_clip"
    }

    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: SamplingConfig(sampler="ode", guidance_scale=1.0)
    )
    """Deterministic rollouts of the current policy, CFG-free (the code's `dgpo_wocfg` presets; `dgpo`: CFG 4.5)."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(std="group", eps=1e-4, clip=5.0, unbiased=False)
    )
    """Per-prompt mean and std + 1e-4 (the code's `grpo` stat tracker; `global_std` for OCR and PickScore), +-5."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=0.0, form="w2"))
    """`beta ||v_theta - v_ref||^2` to the base model (the code: 0 in its base config; GenEval and OCR 0.02,
    PickScore 0.001)."""
    num_draws: int = 4
    """Draws per sample and epoch (the code's `num_train_timesteps`: 4)."""
    t_sampling: Literal["uniform", "logit_normal", "grid", "stratified"] = "grid"
    """Noise levels of the draws, shared by the whole batch: `grid` takes distinct levels among the first
    `trunc_steps + 1` of the sampler's grid (the code)."""
    trunc_steps: int | None = 6
    """`grid`: the draws' grid indices lie in `[0, trunc_steps]` (the code: 6; GenEval 4); None: the whole grid."""
    beta: float = 100.0
    """beta of the group preference (the code's `beta_dpo`: 100; PickScore 10)."""
    dsm_clip: float | None = 5e-2
    """eps of the DSM clip against the lagged copy (the code's `clip_range` with `clip_dsm`: 5e-2; GenEval and OCR
    1e-2, CFG-free presets 1e-3); None: no clip."""
    reference_guidance: float = 1.0
    """CFG of the reference's velocity (the code's `kl_cfg`: 1, CFG-free presets 4.5); 1: its conditional velocity."""
    ema_reference: bool = False
    """Use the lagged copy as the preference's reference instead of the base model (the code's `use_ema_ref`)."""
    old_decay_rate: float = 1e-3
    """u in the lagged copy's decay `d = min(u (S - 1), max)` (the code: 0.001)."""
    old_decay_max: float = 0.3
    """The cap of d (the code: 0.3)."""
    old_sampling_after: int | None = 200
    """Sample with the lagged copy once more than this many optimizer steps were taken (the code's `switch_ema_ref`:
    200; GenEval and OCR 500); None: always the current policy."""

    def checks(self):
        steps = self.sampling.num_steps
        return [
            *super().checks(),
            (self.beta > 0, f"beta must be > 0, got {self.beta}"),
            (self.dsm_clip is None or self.dsm_clip > 0, "dsm_clip must be > 0 (or null: no clip)"),
            (self.reference_guidance >= 1, "reference_guidance must be >= 1 (1: the conditional velocity)"),
            (
                0 <= self.old_decay_max < 1 and self.old_decay_rate >= 0,
                "old_decay_max must be in [0, 1) and old_decay_rate >= 0",
            ),
            (
                self.trunc_steps is None or 0 <= self.trunc_steps < steps,
                f"trunc_steps must lie in [0, sampling.num_steps) = [0, {steps}), got {self.trunc_steps}",
            ),
            (
                self.t_sampling != "grid" or self.trunc_steps is None or self.num_draws <= self.trunc_steps + 1,
                f"t_sampling=grid draws distinct levels of the first trunc_steps + 1 ({(self.trunc_steps or 0) + 1}): "
                f"num_draws ({self.num_draws}) is too large",
            ),
        ]


class LaggedSampler:
    """Rollouts of the current policy, or of the lagged copy once more than `after` optimizer steps were taken."""

    def __init__(self, base, old: EMA, engine, after: int):
        self.base, self.old, self.engine, self.after = base, old, engine, after

    def __call__(self, texts, generators, rows, epoch, **kwargs):
        if self.engine.optimizer_steps <= self.after:
            return self.base(texts, generators, rows, epoch, **kwargs)
        with self.old.swapped():
            return self.base(texts, generators, rows, epoch, **kwargs)


@register("dgpo", description="DGPO: group-level DPO on deterministic rollouts (arXiv:2510.08425)")
class DGPO(PreferenceAlgorithm):
    """DGPO; see the module docstring and `DGPOConfig`."""

    config_class = DGPOConfig
    preference = "dgpo"
    shared_times = True  # the code draws one set of training times per epoch for every sample

    def preference_hparams(self) -> dict:
        hp = {"beta": self.config.beta}
        if self.config.dsm_clip is not None:
            hp["clip_eps_low"] = self.config.dsm_clip
        return hp

    def needs_reference(self) -> bool:
        return not self.config.ema_reference or self.config.kl.beta > 0

    def build(self):
        super().build()
        c = self.config
        self.old = None
        if c.dsm_clip is not None or c.ema_reference or c.old_sampling_after is not None:
            params = [p for p in self.trained_module().parameters() if p.requires_grad]
            self.old = EMA(params, 0.0, prefix="old")  # theta_old starts at theta (the code copies the LoRA)

    def old_decay(self, step: int | None = None) -> float:
        """d after the optimizer step `step` (default: the latest), the code's `min(0.3, 0.001 global_step)` with
        `global_step` the steps before it."""
        c = self.config
        step = self.engine.optimizer_steps if step is None else step
        return min(c.old_decay_rate * max(step - 1, 0), c.old_decay_max)

    def sampling_copies(self):
        return [self.old] if self.old is not None and self.config.old_sampling_after is not None else []

    def sampler(self):
        base = super().sampler()
        if self.old is None or self.config.old_sampling_after is None:
            return base
        return LaggedSampler(base, self.old, self.engine, self.config.old_sampling_after)

    def draw_sigmas(self, rollout):
        """`grid`: the rollout's first `trunc_steps + 1` levels (and the next as the end of the grid)."""
        c = self.config
        if c.t_sampling == "grid" and c.trunc_steps is not None:
            return rollout.sigmas[: c.trunc_steps + 2]
        return rollout.sigmas

    def store_velocity(self) -> bool:
        return self.config.kl.beta > 0

    def reference_guidance(self) -> float | None:
        g = self.config.reference_guidance
        return g if g > 1 else None

    def preference_draws(self, collected, rows, epoch):
        """The shared draws with the base model's errors (and velocities, for the KL) and the lagged copy's."""
        c, rollout = self.config, collected.data
        draws = self.shared_draws(collected, epoch)
        if self.needs_reference():
            losses, velocities = self.draw_losses(
                rollout, draws, rows, reference=True, velocities=self.store_velocity()
            )
            draws = dataclasses.replace(draws, ref_losses=losses, ref_velocity=velocities)
        if c.dsm_clip is not None or c.ema_reference:
            with self.old.swapped():
                old, _ = self.draw_losses(rollout, draws, rows)
            draws = dataclasses.replace(draws, old_losses=old, **({"ref_losses": old} if c.ema_reference else {}))
        return draws

    def draw_terms(self, terms, data, rows, draw, *, v, loss):
        """The DSM clip's log-ratio `l_old - l_theta` and the KL to the base model."""
        c = self.config
        if c.dsm_clip is not None:
            old = data.draws.old_losses[rows, draw].to(loss.device)  # [n]
            terms.inputs["clip_log_ratio"] = old - loss.detach()
        beta = c.kl.coef(self.epoch)
        if beta:
            w2 = velocity_mse(v, data.draws.ref_velocity[rows, draw].to(v.device))  # [n]
            terms.penalty = beta * w2
            terms.logs["w2_loss"] = w2.detach()

    def finish(self, batch, epoch):
        """The lagged copy's update after the epoch's steps."""
        if self.old is None:
            return {}
        d = self.old_decay()
        self.old.update(d)
        return {"dgpo/old_decay": d}

    def lagged_copies(self):
        return [self.old] if self.old is not None else []
