"""The preference trainers' shared base: final samples compared within groups at shared flow-matching draws.

Diffusion-DPO (`flowrl.trainers.image.diffusion_dpo`) and DGPO (`flowrl.trainers.image.dgpo`) keep, like the rest of
the final-sample family (`flowrl.trainers.shared.matching`), only each sample's final latent `x1`, and train on
draws `(t, eps)` of the conditional path `x_t = (1 - t) x1 + t eps` (target `eps - x1`). Their losses compare the
members of a group (a chosen/rejected pair; a prompt's samples), so every member of a group gets the **same** draws:
draw `j` of group `g` comes from `(seed, epoch, 5, 2, g)` (DGPO's times, shared by the whole batch as its code does,
from `(seed, epoch, 5, 1)`), the same on any number of processes and on resume.

Each draw's flow-matching error `l = mean_d (v(x_t, t) - (eps - x1))^2` under the frozen reference is computed once
per epoch, before the update (the reference does not move), and stored with the draws; the update scores the trained
network's `l_theta` and hands the core `logp = -l_theta`, `old_logp = -l_ref` and each row's group: the objective
(`flowrl.core.preference`) sums the implicit rewards `l_ref - l_theta` over each group. Its loss couples a group's
rows, so mini-batches hold whole groups (`updates_groups`) and the update scheduler scores a mini-batch's
micro-batches in two passes and keeps the processes in step (a `batch_statistics` objective): the same update for
any micro-batch size or number of processes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from flowrl.core.ratios import reduce_elements
from flowrl.core.terms import Terms
from flowrl.policies.rollout import per_sample
from flowrl.runtime import seeded
from flowrl.trainers.shared.matching import MatchingAlgorithm, MatchingDraws, conditional_path, draw_times


@dataclasses.dataclass
class PreferenceDraws(MatchingDraws):
    """The epoch's draws, shared within each group, with the reference's (and a lagged copy's) errors at them."""

    ref_losses: torch.Tensor | None = per_sample(default=None)
    """`[B, N]` fp32 flow-matching errors of the reference at the draws."""
    ref_velocity: torch.Tensor | None = per_sample(default=None)
    """`[B, N, ...]` the reference's velocity at the draws (DGPO's KL)."""


def group_draws(
    kind: str,
    keys: torch.Tensor,
    num_draws: int,
    shape,
    seed: tuple[int, ...],
    sigmas=None,
    shared_times: bool = False,
) -> PreferenceDraws:
    """`num_draws` pairs `(t, eps)` per row, the same for the rows of one group: group `key` draws from
    `(*seed, 2, key)`; with `shared_times`, every group takes the times drawn once from `(*seed, 1)`."""
    times = draw_times(kind, (1, num_draws), seeded(*seed, 1), sigmas) if shared_times else None
    drawn = {}
    for key in dict.fromkeys(keys.tolist()):
        generator = seeded(*seed, 2, int(key))
        taus = times if shared_times else draw_times(kind, (1, num_draws), generator, sigmas)
        drawn[key] = (taus, torch.randn((1, num_draws, *shape), generator=generator))
    rows = keys.tolist()
    return PreferenceDraws(taus=torch.cat([drawn[k][0] for k in rows]), noises=torch.cat([drawn[k][1] for k in rows]))


def flow_matching_error(v: torch.Tensor, x1: torch.Tensor, noises: torch.Tensor) -> torch.Tensor:
    """`[n]` fp32 `mean_d (v - (eps - x1))^2` of velocities `v [n, ...]` at draws of samples `x1` with noise `eps`."""
    return reduce_elements((v.float() - (noises.to(x1.device).float() - x1.float())) ** 2, "mean")


class PreferenceAlgorithm(MatchingAlgorithm):
    """Base of the preference trainers; see the module docstring. A subclass names its core objective
    (`preference`) and its hyper-parameters (`preference_hparams`)."""

    preference: ClassVar[str]
    """The core objective (`flowrl.core.preference`): `diffusion_dpo` or `dgpo`."""
    shared_times: ClassVar[bool] = False
    """Whether every group of the epoch trains at the same times (DGPO's code) or each group at its own."""
    updates_groups = True  # the loss compares a group's members: mini-batches of whole groups

    def __init__(self, config, modality, engine):
        super().__init__(config, modality, engine)
        self.objective = self.preference
        self.objective_hparams = self.preference_hparams()
        self.batch_statistics = True  # group sums over the whole mini-batch, reduced over the processes
        self.agg = "token_mean"

    def preference_hparams(self) -> dict:
        return {"beta": self.config.beta}

    def needs_reference(self) -> bool:
        return True  # the implicit rewards are measured against the frozen reference

    # ------------------------------------------------------------------------------------------
    # draws and what is stored with them
    # ------------------------------------------------------------------------------------------

    def draw_sigmas(self, rollout) -> torch.Tensor | None:
        """The grid `t_sampling: grid` draws from (default: the rollout's)."""
        return rollout.sigmas

    def prepare(self, collected, advantages, trainable, epoch):
        """The rollout with its draws (`preference_draws`, scored for the rows that train) as the update's rows."""
        rollout = collected.data
        if rollout.draws is None:
            draws = self.preference_draws(collected, trainable[collected.rows].nonzero().flatten(), epoch)
            rollout = dataclasses.replace(rollout, draws=draws)
        return self.update_batch(collected, advantages, trainable, data=rollout), {}

    def preference_draws(self, collected, rows: torch.Tensor, epoch: int) -> PreferenceDraws:
        """Draws shared within each group, and the reference's errors (and velocities, `store_velocity`) at those of
        the rows `rows` of `collected.data` (the rows that train; the others keep zeros)."""
        draws = self.shared_draws(collected, epoch)
        losses, velocities = self.draw_losses(
            collected.data, draws, rows, reference=True, velocities=self.store_velocity()
        )
        return dataclasses.replace(draws, ref_losses=losses, ref_velocity=velocities)

    def shared_draws(self, collected, epoch: int) -> PreferenceDraws:
        """The epoch's draws of this process's rows, shared within each group (`group_draws`)."""
        c, rollout = self.config, collected.data
        keys = collected.group_ids[collected.rows]
        return group_draws(
            c.t_sampling,
            keys,
            c.num_draws,
            rollout.latents.shape[2:],
            (c.run.seed, epoch, 5),
            self.draw_sigmas(rollout),
            shared_times=self.shared_times,
        )

    def store_velocity(self) -> bool:
        """Whether the reference's velocities are kept with the draws (a KL to the reference)."""
        return False

    def reference_guidance(self) -> float | None:
        """The guidance of the reference's velocity (None: the conditional velocity, as the trained network's)."""
        return None

    @torch.no_grad()
    def draw_losses(self, rollout, draws, rows: torch.Tensor, *, reference: bool = False, velocities: bool = False):
        """`(errors [B, N], velocities [B, N, ...] or None)` at `draws` of the trained network (or the reference) for
        the rows `rows` (zeros elsewhere), scored one draw column and `batch.micro_batch_size` rows at a time."""
        losses = torch.zeros(draws.taus.shape)
        kept = torch.zeros((*draws.taus.shape, *rollout.latents.shape[2:])) if velocities else None
        guidance = self.reference_guidance() if reference else None
        size = self.config.batch.micro_batch_size
        for j in range(draws.taus.shape[1]):
            for start in range(0, len(rows), size):
                chunk = rows[start : start + size]
                part = rollout.select(chunk)
                x1 = part.latents[:, -1].float()
                taus, noises = draws.taus[chunk, j], draws.noises[chunk, j]
                x_t = conditional_path(x1, taus, noises)
                velocity = self.policy.velocity_fn(part, 1, guidance_scale=guidance, reference=reference)
                v = velocity(x_t.to(device=self.policy.device, dtype=self.policy.dtype), taus.float())
                losses[chunk, j] = flow_matching_error(v, x1, noises).cpu()
                if kept is not None:
                    kept[chunk, j] = v.float().cpu()
        return losses, kept

    # ------------------------------------------------------------------------------------------
    # the loss inputs
    # ------------------------------------------------------------------------------------------

    def terms(self, batch, index):
        """`logp = -l_theta`, `old_logp = -l_ref` and the row's group at the draws `index [b, c]`, one forward per
        column (column-major), plus what the algorithm adds (`draw_terms`)."""
        data = batch.data
        b, c = index.shape
        rows, draw, _, x1, _, _, noises, v = self.forward_at_draws(data, index)  # v [n, ...] with its graph
        loss = flow_matching_error(v, x1, noises)  # [n]
        ref = data.draws.ref_losses[rows, draw].to(loss.device)  # [n]
        group = batch.group_ids[rows].to(loss.device).float()  # [n] global group ids (exact as floats)
        logs = {"fm_loss": loss.detach(), "ref_fm_loss": ref, "implicit_reward": ref - loss.detach()}
        terms = Terms(logp=-loss, old_logp=-ref, inputs={"group": group}, logs=logs)
        self.draw_terms(terms, data, rows, draw, v=v, loss=loss)
        return Terms.from_tensors({k: t.reshape(c, b).t() for k, t in terms.tensors().items()})

    def draw_terms(self, terms: Terms, data, rows, draw, *, v, loss) -> None:  # noqa: B027  (an optional hook)
        """Add the algorithm's own inputs or penalties to `terms` (`[n]` each) of the draws `(rows, draw)`."""
