"""The decoupled family: trainers that learn from final samples by flow matching on stored `(t, eps)` draws.

AC-Flow, DiffusionNFT, AWM and image FPO keep only each sample's final latent `x1` and its reward; the
rollout's sampler (any: ODE, SDE, CFG-free) is never re-scored. Each sample gets `num_draws` pairs
`(t_j, eps_j)` per epoch, stored on the rollout (`MatchingDraws`), and a point of its conditional path

    x_t = (1 - t) x1 + t eps,   target velocity  v* = eps - x1   (flowrl's convention: t = 1 is noise, as SD3),

so the draws are the sample's `[B, K]` elements: the core sees `[b, num_draws]` (FPO's mean ratio: `[b, 1]`).
`MatchingAlgorithm` holds what they share: the draws (times uniform, logit-normal, the sampler's grid, or one per
grid stratum; drawn per sample from its position in the epoch, so the same on any number of processes), the
conditional path, the velocity through the prepared module, the column-major scoring layout and the `kl`
regulariser `beta ||v_theta - v_ref||^2` (AC-Flow's W2 bound; NFT's and AWM's "KL").
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar, Literal

import torch

from flowrl.core import velocity_mse
from flowrl.core.copies import to_device
from flowrl.core.terms import Terms
from flowrl.image import ImageConfig
from flowrl.policies.fpo import FPODraws
from flowrl.policies.rollout import per_sample
from flowrl.runtime import seeded
from flowrl.sections import HasGroupFilter, HasKL
from flowrl.trainers.shared.image import ImageAlgorithm


T_SAMPLINGS = ("uniform", "logit_normal", "grid", "stratified")


@dataclasses.dataclass
class MatchingDraws(FPODraws):
    """The epoch's `(t, eps)` draws per sample and what a trainer keeps with them."""

    weights: torch.Tensor | None = per_sample(default=None)
    """`[B, N]` per-draw weight of the loss (AC-Flow's critic weight `g(A)`, NFT's optimality probability `r`)."""
    old_velocity: torch.Tensor | None = per_sample(default=None)
    """`[B, N, ...]` a lagged copy's velocity at the draws (NFT's old policy; AWM's KL-EMA copy)."""
    old_log_probs: torch.Tensor | None = per_sample(default=None)
    """`[B, N]` the behaviour policy's per-draw log-likelihood surrogate (AWM's `-W(l, t)`)."""


@dataclasses.dataclass
class MatchingConfig(HasGroupFilter, ImageConfig):
    """Fields every final-sample trainer shares (those with a `kl` add `HasKL`: its form is `w2`)."""

    kl_forms: ClassVar[tuple[str, ...]] = ("w2",)

    num_draws: int = 2
    """`(t, eps)` draws per sample and epoch: the sample's elements."""
    t_sampling: Literal["uniform", "logit_normal", "grid", "stratified"] = "uniform"
    """Noise levels of the draws: `uniform` on (0, 1); `logit_normal` (SD3's training density); `grid`: distinct
    noise levels of the sampler's grid, a random permutation per sample (DiffusionNFT); `stratified`: one grid
    level per stratum of the grid indices `[1, int(0.9 T)]` (AWM's `discrete_wo_init`)."""

    def checks(self):
        steps = self.sampling.num_steps
        return [
            *super().checks(),
            (self.num_draws >= 1, "num_draws must be >= 1"),
            (
                self.t_sampling != "grid" or self.num_draws <= steps,
                f"t_sampling=grid draws distinct grid levels: num_draws ({self.num_draws}) must be <= "
                f"sampling.num_steps ({steps})",
            ),
            (
                self.t_sampling != "stratified" or self.num_draws <= int(0.9 * steps) - 1,
                f"t_sampling=stratified needs num_draws ({self.num_draws}) <= int(0.9 * sampling.num_steps) - 1 "
                f"({int(0.9 * steps) - 1}) strata",
            ),
        ]


def draw_times(kind: str, shape: tuple[int, int], generator: torch.Generator, sigmas: torch.Tensor | None = None):
    """`[B, N]` noise levels of the draws (`MatchingConfig.t_sampling`); `sigmas [T + 1]`: the sampler's grid."""
    b, n = shape
    if kind == "uniform":
        return torch.rand(shape, generator=generator)
    if kind == "logit_normal":
        return torch.sigmoid(torch.randn(shape, generator=generator))
    levels = sigmas[:-1].float().cpu()  # [T] the grid's noise levels, 1 (pure noise) first
    if kind == "grid":  # DiffusionNFT: the grid permuted per sample, the first n
        order = torch.argsort(torch.rand((b, len(levels)), generator=generator), dim=1)[:, :n]
        return levels[order]
    if kind == "stratified":  # AWM: floor(linspace(1, int(0.9 T), n + 1)) strata, one index drawn in each
        edges = torch.linspace(1, int(0.9 * len(levels)), n + 1).floor().long()
        lo, width = edges[:-1], (edges[1:] - edges[:-1]).clamp_min(1)
        index = lo + (torch.rand((b, n), generator=generator) * width).long().clamp(max=width - 1)
        return levels[index]
    raise ValueError(f"t_sampling must be one of {', '.join(T_SAMPLINGS)}, got {kind!r}")


def conditional_path(x1: torch.Tensor, taus: torch.Tensor, noises: torch.Tensor) -> torch.Tensor:
    """States `x_t = (1 - t) x1 + t eps` `[n, ...]` of samples `x1 [n, ...]` at `taus [n]` (target `eps - x1`)."""
    t = to_device(taus.reshape(-1, *([1] * (x1.ndim - 1))), x1.device)
    return (1 - t) * x1 + t * to_device(noises, x1.device)


def row_draws(kind: str, rows, num_draws: int, shape, seed: tuple[int, ...], sigmas=None) -> MatchingDraws:
    """`num_draws` pairs `(t, eps)` for each sample at positions `rows` of the epoch, drawn from `(*seed, row)`: a
    sample's draws are the same whichever process holds it."""
    taus, noises = [], []
    for row in rows:
        generator = seeded(*seed, int(row))
        taus.append(draw_times(kind, (1, num_draws), generator, sigmas))
        noises.append(torch.randn((1, num_draws, *shape), generator=generator))
    return MatchingDraws(taus=torch.cat(taus), noises=torch.cat(noises))


class MatchingAlgorithm(ImageAlgorithm):
    """Base of the final-sample algorithms (draws, the conditional path, velocities); see the module docstring.
    Their loss is per draw (`PerDrawAlgorithm`) or the algorithm's own `terms` (image FPO's per-sample ratio)."""

    requires_stochastic = False  # they train on final samples; ODE rollouts are fine
    image_scale = False  # their ratios (AWM, FPO) are not Gaussian step log-probs: no image-scale clip presets

    time_kinds = ("flow",)  # velocities along the flow path

    def make_draws(self, rollout, rows: torch.Tensor, epoch: int) -> MatchingDraws:
        """`num_draws` pairs `(t, eps)` per sample of this process (at positions `rows`), from `(seed, epoch, 5)`."""
        c = self.config
        return row_draws(
            c.t_sampling, rows, c.num_draws, rollout.latents.shape[2:], (c.run.seed, epoch, 5), rollout.sigmas
        )

    def prepare_draws(self, collected, advantages: torch.Tensor, epoch: int) -> MatchingDraws:
        """The epoch's draws with what the algorithm stores before its update (the behaviour policy's losses, ...)."""
        return self.make_draws(collected.data, collected.rows, epoch)

    def prepare(self, collected, advantages, trainable, epoch):
        """The rollout with its draws (`prepare_draws`) as the update's rows."""
        rollout = collected.data
        if rollout.draws is None:
            rollout = dataclasses.replace(rollout, draws=self.prepare_draws(collected, advantages, epoch))
        return self.update_batch(collected, advantages, trainable, data=rollout), {}

    def velocity(self, batch, x: torch.Tensor, t: torch.Tensor, *, reference: bool = False) -> torch.Tensor:
        """The conditional velocity `v(x_t, t, c)` of the trained network (through its prepared module) or of the
        reference: `DiffusionPolicy.velocity_fn` with one draw per sample (no CFG; Flux keeps its guidance)."""
        velocity = self.policy.velocity_fn(batch, 1, reference=reference)
        return velocity(x.to(device=self.policy.device, dtype=self.policy.dtype), t.float())

    @torch.no_grad()
    def at_draws(self, rollout, fn) -> list:
        """`fn(rows_batch, x1, x_t, taus, noises, v)` for every draw column and chunk of `batch.micro_batch_size`
        rows of `rollout` (its `draws` set), under the current weights: the chunks a training micro-batch forwards
        in, so values stored here reproduce exactly at the same weights. Returns the results, column-major."""
        out = []
        size = self.config.batch.micro_batch_size
        for j in range(rollout.draws.taus.shape[1]):
            for start in range(0, len(rollout), size):
                rows = torch.arange(start, min(start + size, len(rollout)))
                part = rollout.select(rows)
                x1 = part.latents[:, -1].float()
                taus, noises = part.draws.taus[:, j], part.draws.noises[:, j]
                x_t = conditional_path(x1, taus, noises)
                out.append((rows, j, fn(part, x1, x_t, taus, noises, self.velocity(part, x_t, taus))))
        return out

    def forward_at_draws(self, data, index: torch.Tensor):
        """The current velocity at the draws `index [b, c]` of `data`, one forward per column (column-major: each
        column's b rows are one forward chunk). Returns `(rows, draw, pairs, x1, x_t, taus, noises, v)`, `[n = b c]`
        rows each, `v` with its graph."""
        b, c = index.shape
        rows = torch.arange(b).repeat(c)
        draw = index.t().reshape(-1)
        pairs = data.select(rows)
        taus, noises = data.draws.taus[rows, draw], data.draws.noises[rows, draw]  # [n], [n, ...]
        x1 = pairs.latents[:, -1].float()
        x_t = conditional_path(x1, taus, noises)
        return rows, draw, pairs, x1, x_t, taus, noises, self.velocity(pairs, x_t, taus)

    def num_elements(self, data) -> int:
        return self.config.num_draws

    def elements(self, batch, epoch):
        """Each sample trains on its draws `0 .. num_draws - 1`."""
        return torch.arange(self.config.num_draws).expand(len(batch.data), -1), None


class PerDrawAlgorithm(MatchingAlgorithm):
    """A final-sample algorithm whose loss inputs are per draw: it implements `draw_terms`."""

    def terms(self, batch, index):
        """`draw_terms` at the draws `index [b, c]`, one forward per column (column-major), plus the `kl` term
        `beta ||v_theta - v_ref||^2`."""
        data = batch.data
        b, c = index.shape
        rows, draw, pairs, x1, x_t, taus, noises, v = self.forward_at_draws(data, index)
        terms = self.draw_terms(data, rows, draw, x1=x1, x_t=x_t, taus=to_device(taus, x1.device), noises=noises, v=v)
        beta = self.config.kl.coef(self.epoch) if isinstance(self.config, HasKL) else 0.0
        if beta:
            w2 = velocity_mse(v, self.velocity(pairs, x_t, taus, reference=True))  # [n]
            terms.penalty = beta * w2 if terms.penalty is None else terms.penalty + beta * w2
            terms.logs["w2_loss"] = w2.detach()
        return Terms.from_tensors({k: t.reshape(c, b).t() for k, t in terms.tensors().items()})

    @abstractmethod
    def draw_terms(self, batch, rows: torch.Tensor, draw: torch.Tensor, *, x1, x_t, taus, noises, v) -> Terms:
        """`Terms` (`[n]` each) of the `n` draws `(rows, draw)` of `batch`: `x1`, `x_t`, `taus`, `noises` and the
        current velocity `v` (with its graph) at them."""
