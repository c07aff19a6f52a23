"""DiffusionNFT: negative-aware fine-tuning on the forward process (Zheng et al. 2025, arXiv:2509.16117).

No likelihoods and no trajectories: an **old policy** `v_old` (a lagged copy of the weights) samples the epoch
with any solver (CFG-free; flowrl's default the Euler ODE), and only each sample's final latent `x1` and reward
are kept. The reward becomes an optimality probability per sample,

    r = 1/2 + 1/2 clip(A / Z, -1, 1),   A = (R - mean_prompt R) / (std_epoch + 1e-4)   (Z = 5: NVlabs' code),

and the current velocity `v_theta` defines two implicit policies (paper sec. 3, eq. 5-6)

    v+ = (1 - beta) v_old + beta v_theta,     v- = (1 + beta) v_old - beta v_theta     (v+ + v- = 2 v_old),

trained by flow matching on the forward process at the stored draws `(t, eps)` (`MatchingTrainer`):

    L = (Z / beta) E[ r l(v+) + (1 - r) l(v-) ]   (+ kl.beta ||v_theta - v_ref||^2),

with `l` the authors' code's x0 regression with an adaptive weight, `x^0 = x_t - t v`,
`l(v) = mean_d (x^0 - x1)^2 / sg(max(mean_d |x^0 - x1|, 1e-5))` (`loss: x0_adaptive`), or the paper's velocity
error `mean_d (v - (eps - x1))^2` (`loss: velocity`). At `theta = theta_old` the gradient is
`clip(A, -Z, Z) grad l(v_theta)` for any beta: an advantage-weighted flow-matching step whose negatives push
away from bad samples (tested). After each epoch the old policy moves towards the new one,
`theta_old <- eta theta_old + (1 - eta) theta`, `eta = min(old_decay_rate * max(0, step - old_decay_flat),
old_decay_max)` (`return_decay`, step = the optimizer steps taken so far, read after the epoch's steps as
`train_nft_sd3.py` does: epoch 1 with S steps already uses `min(old_decay_rate * S, old_decay_max)`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from flowrl.core.ratios import reduce_elements
from flowrl.core.terms import Terms
from flowrl.image import SamplingConfig
from flowrl.run.registry import register
from flowrl.run.state import EMA
from flowrl.sections import AdvantageConfig, HasKL, KLConfig
from flowrl.trainers.shared.matching import MatchingConfig, PerDrawAlgorithm


def optimality(advantages: torch.Tensor, scale: float) -> torch.Tensor:
    """NFT's optimality probability `r = 1/2 + 1/2 clip(A / Z, -1, 1)` in [0, 1]; 1/2 exactly at `A = 0`."""
    return 0.5 + 0.5 * (advantages.float() / scale).clamp(-1.0, 1.0)


def implicit_velocities(v: torch.Tensor, v_old: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(v+, v-) = ((1 - beta) v_old + beta v, (1 + beta) v_old - beta v)`: NFT's positive and negative policies."""
    v_old = v_old.to(v)
    return v_old + beta * (v - v_old), v_old - beta * (v - v_old)


def nft_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    x1: torch.Tensor,
    x_t: torch.Tensor,
    noises: torch.Tensor,
    taus: torch.Tensor,
    r: torch.Tensor,
    *,
    beta: float,
    scale: float,
    form: str = "x0_adaptive",
) -> tuple[torch.Tensor, dict]:
    """Per-draw NFT loss `[n]`: `(Z / beta) (r l(v+) + (1 - r) l(v-))` (see the module docstring) and logs.

    Shapes: `v`, `v_old`, `x1`, `x_t`, `noises` `[n, ...]`; `taus`, `r` `[n]`. Math in fp32.
    """
    v32 = v.float()
    v_pos, v_neg = implicit_velocities(v32, v_old.float(), beta)  # [n, ...] each
    if form == "x0_adaptive":
        t = taus.float().reshape(-1, *([1] * (v.ndim - 1)))

        def loss(velocity):
            err = x_t.float() - t * velocity - x1.float()  # x^0 - x1 = t (v* - v)
            # adaptive weight, no gradient; floor 1e-5 keeps a perfect prediction finite (the authors' guard)
            weight = reduce_elements(err.abs(), "mean").detach().clamp_min(1e-5)  # [n]
            return reduce_elements(err**2, "mean") / weight
    elif form == "velocity":
        target = noises.float() - x1.float()

        def loss(velocity):
            return reduce_elements((velocity - target) ** 2, "mean")
    else:
        raise ValueError(f"loss must be 'x0_adaptive' or 'velocity', got {form!r}")
    pos, neg = loss(v_pos), loss(v_neg)  # [n]
    value = (scale / beta) * (r * pos + (1 - r) * neg)
    return value, {"positive_loss": pos.detach(), "negative_loss": neg.detach()}


@dataclasses.dataclass
class NFTConfig(HasKL, MatchingConfig):
    kl_forms: ClassVar[tuple[str, ...]] = ("w2",)
    renamed: ClassVar[dict[str, str]] = {"beta": "guidance_strength (beta in the paper; kl.beta is the KL weight)"}

    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: SamplingConfig(sampler="ode", guidance_scale=1.0)
    )
    """CFG-free deterministic sampling by the old policy (NVlabs: DPM-Solver++(2M), 10 steps; flowrl: Euler)."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(std="global", eps=1e-4, clip=5.0, unbiased=False)
    )
    """Per-prompt mean, one population std over the epoch + 1e-4 (`global_std`), clipped to +-5."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(beta=0.0, form="w2"))
    """`beta ||v_theta - v_ref||^2` to the base model (NVlabs: 1e-4; off here)."""
    num_draws: int = 9
    """Training noise levels per sample (NVlabs: the first int(10 * 0.99) = 9 of the permuted grid)."""
    t_sampling: Literal["uniform", "logit_normal", "grid", "stratified"] = "grid"
    """The sampler's grid levels, permuted per sample (NVlabs)."""
    guidance_strength: float = 1.0
    """beta of the implicit policies `v+- = v_old +- beta (v_theta - v_old)` (NVlabs: 1.0; 0.1 for OCR and
    multi-reward), named apart from `kl.beta`, the KL weight."""
    optimality_scale: float = 5.0
    """Z in `r = 1/2 + 1/2 clip(A / Z, -1, 1)` and the loss factor `Z / beta` (NVlabs: `adv_clip_max` 5)."""
    loss: Literal["x0_adaptive", "velocity"] = "x0_adaptive"
    """`x0_adaptive`: the code's x0 regression with adaptive weight; `velocity`: the paper's velocity error."""
    old_decay_rate: float = 1e-3
    """u in the old policy's decay `eta = min(u max(0, step - flat), max)` (NVlabs type 1: 1e-3; type 2: 7.5e-3)."""
    old_decay_flat: int = 0
    """Optimizer steps before eta starts to grow (type 1: 0; type 2: 75)."""
    old_decay_max: float = 0.5
    """The cap of eta (type 1: 0.5; type 2: 0.999; 0: the old policy is always a copy)."""

    def checks(self):
        return [
            *super().checks(),
            (self.guidance_strength > 0, "guidance_strength must be > 0"),
            (self.optimality_scale > 0, "optimality_scale must be > 0"),
            (0 <= self.old_decay_max < 1, "old_decay_max must be in [0, 1)"),
            (self.old_decay_rate >= 0 and self.old_decay_flat >= 0, "old_decay_rate and old_decay_flat must be >= 0"),
        ]


class OldPolicySampler:
    """Rollouts of the old policy: the sampler called with the lagged weights `theta_old` swapped in."""

    def __init__(self, base, old: EMA):
        self.base, self.old = base, old

    def __call__(self, texts, generators, rows, epoch, **kwargs):
        with self.old.swapped():  # (kwargs: the editing prompts' `sources`)
            return self.base(texts, generators, rows, epoch, **kwargs)


@register(
    "diffusion_nft", description="DiffusionNFT: negative-aware flow matching on the forward process (arXiv:2509.16117)"
)
class DiffusionNFT(PerDrawAlgorithm):
    """DiffusionNFT; see the module docstring and `NFTConfig`."""

    config_class = NFTConfig

    def build(self):
        super().build()
        params = [p for p in self.trained_module().parameters() if p.requires_grad]
        self.old = EMA(params, 0.0, prefix="old")  # theta_old starts at theta

    def old_decay(self, step: int | None = None) -> float:
        """eta at optimizer step `step` (default: the current one)."""
        c = self.config
        step = self.engine.optimizer_steps if step is None else step
        return min(c.old_decay_rate * max(0, step - c.old_decay_flat), c.old_decay_max)

    def sampling_copies(self):
        return [self.old]

    def sampler(self):
        """Rollouts come from the old policy."""
        return OldPolicySampler(super().sampler(), self.old)

    def prepare_draws(self, collected, advantages, epoch):
        """The draws, the old velocity at them and each sample's optimality `r` (as the draws' weights)."""
        rollout = collected.data
        draws = self.make_draws(rollout, collected.rows, epoch)
        device = rollout.latents.device  # kept beside the latents: no copy back to the host per chunk
        velocities = torch.empty((*draws.taus.shape, *rollout.latents.shape[2:]), device=device)  # [B, N, ...]
        with self.old.swapped():
            for rows, j, v in self.at_draws(dataclasses.replace(rollout, draws=draws), lambda *args: args[-1]):
                velocities[rows.to(device), j] = v.float()
        r = optimality(advantages[collected.rows], self.config.optimality_scale)  # [B]
        return dataclasses.replace(draws, old_velocity=velocities, weights=r[:, None].expand(-1, draws.taus.shape[1]))

    def prepare(self, collected, advantages, trainable, epoch):
        batch, stats = super().prepare(collected, advantages, trainable, epoch)
        r = optimality(advantages[trainable], self.config.optimality_scale)
        return batch, {**stats, "nft/r_mean": r.mean()}

    def finish(self, batch, epoch):
        """The old policy's soft update, after the flow-matching steps: eta at the optimizer steps taken so far,
        this epoch's included (NVlabs reads `global_step` after the epoch's gradient steps)."""
        eta = self.old_decay()
        self.old.update(eta)
        return {"nft/old_decay": eta}

    def draw_terms(self, batch, rows, draw, *, x1, x_t, taus, noises, v):
        """NFT's loss at the draws (`nft_loss`)."""
        c = self.config
        r = batch.draws.weights[rows, draw].to(x1.device)  # [n]
        v_old = batch.draws.old_velocity[rows, draw].to(x1.device)  # [n, ...]
        value, logs = nft_loss(
            v,
            v_old,
            x1,
            x_t,
            noises.to(x1.device),
            taus,
            r,
            beta=c.guidance_strength,
            scale=c.optimality_scale,
            form=c.loss,
        )
        return Terms(loss=value, logs=logs)

    def lagged_copies(self):
        return [self.old]
