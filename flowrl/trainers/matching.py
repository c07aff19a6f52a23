"""The decoupled family: trainers that learn from final samples by flow matching on stored `(t, eps)` draws.

AC-Flow, DiffusionNFT, AWM and image FPO keep only each sample's final latent `x1` and its reward; the
rollout's sampler (any: ODE, SDE, CFG-free) is never re-scored. Each sample gets `num_draws` pairs
`(t_j, eps_j)` per epoch, stored on the rollout (`MatchingDraws`), and a point of its conditional path

    x_t = (1 - t) x1 + t eps,   target velocity  v* = eps - x1   (flowrl's convention: t = 1 is noise, as SD3),

so the draws are the sample's `[B, K]` elements: the core sees `[b, num_draws]` (FPO's mean ratio: `[b, 1]`).
`MatchingTrainer` holds what they share: the draws (times uniform, logit-normal, the sampler's grid, or one per
grid stratum), the conditional path, the velocity through the prepared module, the column-major scoring layout
and the `kl` regulariser `beta ||v_theta - v_ref||^2` (AC-Flow's W2 bound; NFT's and AWM's "KL").
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from flowrl.config import TrainerConfig
from flowrl.core import velocity_mse
from flowrl.policies.fpo import FPODraws
from flowrl.policies.rollout import per_sample
from flowrl.trainers.image import ImageTrainer
from flowrl.trainers.state import seeded
from flowrl.trainers.update import Terms


T_SAMPLINGS = ("uniform", "logit_normal", "grid", "stratified")


@dataclasses.dataclass
class MatchingDraws(FPODraws):
    """The epoch's `(t, eps)` draws per sample and what a trainer keeps with them."""

    weights: torch.Tensor | None = per_sample(default=None)
    """`[B, N]` per-draw weight of the loss (AC-Flow's critic weight `g(A)`, NFT's optimality probability `r`)."""
    old_velocity: torch.Tensor | None = per_sample(default=None)
    """`[B, N, ...]` the old policy's velocity at the draws (NFT's implicit policies)."""
    old_log_probs: torch.Tensor | None = per_sample(default=None)
    """`[B, N]` the behaviour policy's per-draw log-likelihood surrogate (AWM's `-W(l, t)`)."""


@dataclasses.dataclass
class MatchingConfig(TrainerConfig):
    """Fields every final-sample trainer shares."""

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
            (self.t_sampling != "grid" or self.num_draws <= steps,
             f"t_sampling=grid draws distinct grid levels: num_draws ({self.num_draws}) must be <= sampling.num_steps "
             f"({steps})"),
            (self.t_sampling != "stratified" or self.num_draws <= int(0.9 * steps) - 1,
             f"t_sampling=stratified needs num_draws ({self.num_draws}) <= int(0.9 * sampling.num_steps) - 1 "
             f"({int(0.9 * steps) - 1}) strata"),
        ]  # fmt: skip


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
    t = taus.reshape(-1, *([1] * (x1.ndim - 1))).to(x1.device)
    return (1 - t) * x1 + t * noises.to(x1.device)


class MatchingTrainer(ImageTrainer):
    """Base of the final-sample trainers; see the module docstring. A subclass implements `draw_terms`."""

    requires_stochastic = False  # they train on final samples; ODE rollouts are fine
    image_scale = False  # their ratios (AWM, FPO) are not Gaussian step log-probs: no image-scale clip presets

    def setup(self):
        if self.policy.adapter.time_kind != "flow":
            family, name = self.policy.family, self.config.trainer
            raise ValueError(f"{name} needs a flow-matching (velocity) model; a {family} model predicts noise")

    def make_draws(self, rollout, epoch: int) -> MatchingDraws:
        """`num_draws` pairs `(t, eps)` per sample of this process, drawn from `(seed, epoch, 5, rank)`."""
        c = self.config
        x1 = rollout.latents[:, -1]
        generator = seeded(c.run.seed, epoch, 5, self.processes.rank)
        taus = draw_times(c.t_sampling, (len(rollout), c.num_draws), generator, rollout.sigmas)
        noises = torch.randn((len(rollout), c.num_draws, *x1.shape[1:]), generator=generator)
        return MatchingDraws(taus=taus, noises=noises)

    def prepare_draws(self, rollout, advantages: torch.Tensor, epoch: int) -> MatchingDraws:
        """The epoch's draws with what the trainer stores before its update (the behaviour policy's losses, ...)."""
        return self.make_draws(rollout, epoch)

    def update(self, rollout, advantages, trainable, epoch):
        """`prepare_draws` (unless the rollout carries draws already), then the shared minibatch update."""
        if rollout.draws is None:
            rollout = dataclasses.replace(rollout, draws=self.prepare_draws(rollout, advantages, epoch))
        return super().update(rollout, advantages, trainable, epoch)

    def velocity(self, batch, x: torch.Tensor, t: torch.Tensor, *, reference: bool = False) -> torch.Tensor:
        """The conditional velocity `v(x_t, t, c)` of the trained network (through its prepared module) or of the
        reference: `DiffusionPolicy.velocity_fn` with one draw per sample (no CFG; Flux keeps its guidance)."""
        velocity = self.policy.velocity_fn(batch, 1, reference=reference)
        return velocity(x.to(device=self.policy.device, dtype=self.policy.dtype), t.float())

    @torch.no_grad()
    def at_draws(self, rollout, fn) -> list:
        """`fn(rows_batch, x1, x_t, taus, noises, v)` for every draw column and chunk of `forward_batch_size` rows of
        `rollout` (its `draws` set), under the current weights: the chunks a training minibatch forwards in, so
        values stored here reproduce exactly at the same weights. Returns the results, column-major."""
        out = []
        size = self.config.sampling.forward_batch_size
        for j in range(rollout.draws.taus.shape[1]):
            for start in range(0, len(rollout), size):
                rows = torch.arange(start, min(start + size, len(rollout)))
                part = rollout.select(rows)
                x1 = part.latents[:, -1].float()
                taus, noises = part.draws.taus[:, j], part.draws.noises[:, j]
                x_t = conditional_path(x1, taus, noises)
                out.append((rows, j, fn(part, x1, x_t, taus, noises, self.velocity(part, x_t, taus))))
        return out

    def num_elements(self, rollout) -> int:
        return self.config.num_draws

    def train_elements(self, rollout, epoch):
        """Each sample trains on its draws `0 .. num_draws - 1`."""
        return torch.arange(self.config.num_draws).expand(len(rollout), -1)

    def score(self, batch, index):
        """`draw_terms` at the draws `index [b, c]`, one forward per column (column-major), plus the `kl` term
        `beta ||v_theta - v_ref||^2`."""
        b, c = index.shape
        rows = torch.arange(b).repeat(c)  # column-major: each column's b rows are one forward chunk
        draw = index.t().reshape(-1)
        pairs = batch.select(rows)
        taus, noises = batch.draws.taus[rows, draw], batch.draws.noises[rows, draw]  # [n], [n, ...]
        x1 = pairs.latents[:, -1].float()
        x_t = conditional_path(x1, taus, noises)
        v = self.velocity(pairs, x_t, taus)
        terms = self.draw_terms(batch, rows, draw, x1=x1, x_t=x_t, taus=taus.to(x1.device), noises=noises, v=v)
        beta = self.config.kl.coef(self.state.epoch)
        if beta:
            w2 = velocity_mse(v, self.velocity(pairs, x_t, taus, reference=True))  # [n]
            terms.penalty = beta * w2 if terms.penalty is None else terms.penalty + beta * w2
            terms.logs["w2_loss"] = w2.detach()
        return Terms.from_tensors({k: t.reshape(c, b).t() for k, t in terms.tensors().items()})

    def draw_terms(self, batch, rows: torch.Tensor, draw: torch.Tensor, *, x1, x_t, taus, noises, v) -> Terms:
        """`Terms` (`[n]` each) of the `n` draws `(rows, draw)` of `batch`: `x1`, `x_t`, `taus`, `noises` and the
        current velocity `v` (with its graph) at them. A subclass implements this or replaces `score`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither draw_terms nor score")
