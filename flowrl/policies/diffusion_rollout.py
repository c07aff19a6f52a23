"""The image modality's rollout records: `DiffusionRollout` (sampled trajectories with what re-scores them) and
`Transitions` (its single-step view: DPOK's replay buffer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from flowrl.core.copies import to_device
from flowrl.policies.fpo import FPODraws
from flowrl.policies.noise import NoiseDraws
from flowrl.policies.rollout import Record, per_sample


@dataclass
class DiffusionRollout(Record):
    """Sampled trajectories with everything needed to re-score them: the image modality's `Rollout`.

    `B` samples, `T` denoising steps, latents `[C, h, w]` (Flux: packed tokens). The elements the core sees
    are the T steps: `log_probs [B, T]` with `mask [B, T]` the stochastic ones.
    """

    prompts: list[str] = per_sample()
    """The prompt of each sample."""
    prompt_ids: torch.Tensor = per_sample()
    """`[B]` index of each sample's prompt in `unique_prompts` (the group id for group advantages)."""
    latents: torch.Tensor = per_sample()
    """`[B, T + 1, ...]` states `x_0` (noise) ... `x_T` in the model's dtype and layout (`[C, h, w]`; Flux:
    packed tokens `[h*w/4, 4C]`)."""
    log_probs: torch.Tensor = per_sample()
    """`[B, T]` fp32 log-probability of each transition under the behaviour policy (0 on deterministic steps)."""
    unique_prompts: list[str] = field(default_factory=list)
    """Distinct prompts in order of first appearance."""
    sampler: str = "flow_sde"
    """The step kernel (`flowrl.policies.sde`) and its settings: the rollout's sampling recipe."""
    noise_level: float = 0.0
    guidance_scale: float = 1.0
    forward_batch_size: int = 1
    """Rows per network forward at rollout; re-scoring uses the same so log-probs reproduce exactly."""
    reduce: str = "mean"
    height: int = 0
    width: int = 0
    sde_mask: torch.Tensor | None = None
    """`[T]` bool: the steps that were stochastic (the trainable ones)."""
    timesteps: torch.Tensor | None = None
    """`[T]` timesteps as the network saw them."""
    sigmas: torch.Tensor | None = None
    """`[T + 1]` flow-matching noise levels (for DDIM: the noise level with the same signal-to-noise ratio)."""
    stds: torch.Tensor | None = None
    """`[T]` std of each step's Gaussian (0 on deterministic steps)."""
    cond: dict[str, torch.Tensor] = field(default_factory=dict)
    """Conditioning of `unique_prompts` (`[P, ...]` each)."""
    null_cond: dict[str, torch.Tensor] | None = None
    """Conditioning of the negative prompt (`[1, ...]`) when classifier-free guidance is on."""
    static: dict = field(default_factory=dict)
    """Size-dependent network inputs (Flux's image ids)."""
    images: torch.Tensor | None = per_sample(default=None)
    """`[B, 3, H, W]` decoded images in [0, 1]."""
    means: torch.Tensor | None = per_sample(default=None)
    """`[B, T, ...]` fp32 behaviour-policy means of each step (`store_means=True`; GRPO-Guard needs them)."""
    noise: NoiseDraws | None = per_sample(default=None)
    """FIND: the initial noise drawn from the noise policy, its conditions and behaviour log-probabilities."""
    draws: FPODraws | None = per_sample(default=None)
    """Conditional flow-matching draws `(tau, eps)` per sample (AC-Flow; FPO also keeps the behaviour losses)."""
    stochastic_step: torch.Tensor | None = per_sample(default=None)
    """`[B]` the one stochastic step of each sample when samples branch at different steps (TempFlow-GRPO); then
    `sde_mask` is the union over the samples. None: `sde_mask` holds for every sample."""
    edit_ids: torch.Tensor | None = per_sample(default=None)
    """`[B]` editing: each sample's (prompt, source images) pair, its index in `edit_keys` (None: text-to-image)."""
    edit_keys: list[str] = field(default_factory=list)
    """Editing: the distinct (prompt, source images) pairs (`flowrl.policies.sources.edit_key`)."""
    edit_cond: dict[str, torch.Tensor] = field(default_factory=dict)
    """Editing: the pairs' conditioning (`[S, ...]` each; FLUX.1 Kontext: packed source latents and image ids),
    added to each sample's text conditioning."""
    source_pixels: torch.Tensor | None = None
    """Editing: `[S, N, 3, H, W]` the pairs' source images in [0, 1] as the model saw them."""

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

    @property
    def sde_steps(self) -> torch.Tensor:
        """Indices of the stochastic steps."""
        return self.sde_mask.nonzero().flatten()

    @property
    def mask(self) -> torch.Tensor:
        """`[B, T]` bool: the stochastic steps of every sample."""
        if self.stochastic_step is not None:
            return torch.nn.functional.one_hot(self.stochastic_step, self.num_steps).bool()
        return self.sde_mask.unsqueeze(0).expand(len(self), -1)

    @property
    def group_ids(self) -> torch.Tensor:
        """`[B]` the prompt of each sample (its index in `unique_prompts`; editing: its pair's in `edit_keys`)."""
        return self.prompt_ids if self.edit_ids is None else self.edit_ids

    @property
    def source_images(self) -> torch.Tensor | None:
        """`[B, N, 3, H, W]` each sample's source images in [0, 1] (editing; None: text-to-image)."""
        if self.edit_ids is None:
            return None
        return self.source_pixels[self.edit_ids.to(self.source_pixels.device)]

    def sample_cond(self, rows: torch.Tensor | None = None, repeat: int = 1) -> dict[str, torch.Tensor]:
        """The conditioning of the samples `rows [n]` (default: every sample, each `repeat` times; `[n, ...]`): its
        prompt's text conditioning and, editing, its (prompt, source images) pair's."""
        rows = torch.arange(len(self.prompt_ids)).repeat_interleave(repeat) if rows is None else rows.cpu()
        ids = self.prompt_ids.cpu()[rows]
        cond = {k: v[to_device(ids, v.device)] for k, v in self.cond.items()}  # host ids
        if self.edit_ids is not None:
            ids = self.edit_ids.cpu()[rows]
            cond.update({k: v[ids.to(v.device)] for k, v in self.edit_cond.items()})
        return cond

    @classmethod
    def cat(cls, parts: Sequence[DiffusionRollout]) -> DiffusionRollout:
        """One rollout from `parts` sampled with the same settings (an epoch sampled in parts, in order).

        Per-sample fields are concatenated; each distinct prompt keeps the conditioning of its first part.
        """
        parts = list(parts)
        shared = ("unique_prompts", "cond", "prompt_ids", "edit_keys", "edit_cond", "source_pixels")
        joined = super().cat(parts, shared_from_first=shared)
        unique = list(dict.fromkeys(joined.prompts))
        position = {p: i for i, p in enumerate(unique)}
        source = {}  # prompt -> (part, row in that part's cond)
        for part in parts:
            for j, p in enumerate(part.unique_prompts):
                source.setdefault(p, (part, j))
        cond = {k: torch.stack([source[p][0].cond[k][source[p][1]] for p in unique]) for k in parts[0].cond}
        ids = torch.tensor([position[p] for p in joined.prompts])
        joined = replace(joined, prompt_ids=ids, unique_prompts=unique, cond=cond)
        return joined if joined.edit_ids is None else _cat_edits(joined, parts)

    def to_transitions(self, rows: torch.Tensor, steps: torch.Tensor) -> Transitions:
        """The single steps `x_t -> x_{t+1}` of samples `rows [n]` at steps `steps [n]` (a replay buffer's view).

        `prompts` of the transitions are the samples' prompt texts' indices in `unique_prompts`.
        """
        dev = self.latents.device
        r, s = rows.to(dev), steps.to(dev)
        return Transitions(
            states=self.latents[r, s],
            next_states=self.latents[r, s + 1],
            steps=steps.cpu(),
            prompts=self.prompt_ids[rows.to(self.prompt_ids.device)].cpu(),
            log_probs=self.log_probs[r, s].float().cpu(),
            rewards=torch.zeros(len(rows)),
        )


def _cat_edits(joined: DiffusionRollout, parts: list[DiffusionRollout]) -> DiffusionRollout:
    """`joined` with its parts' (prompt, source images) pairs merged: each pair keeps its first part's tensors."""
    keys = [part.edit_keys[i] for part in parts for i in part.edit_ids.tolist()]
    unique = list(dict.fromkeys(keys))
    first = {}  # pair -> (part, row in that part's pairs)
    for part in parts:
        for j, key in enumerate(part.edit_keys):
            first.setdefault(key, (part, j))
    cond = {n: torch.stack([first[k][0].edit_cond[n][first[k][1]] for k in unique]) for n in parts[0].edit_cond}
    pixels = torch.stack([first[k][0].source_pixels[first[k][1]] for k in unique])
    position = {k: i for i, k in enumerate(unique)}
    ids = torch.tensor([position[k] for k in keys])
    return replace(joined, edit_ids=ids, edit_keys=unique, edit_cond=cond, source_pixels=pixels)


@dataclass
class Transitions(Record):
    """`n` single denoising steps `x_t -> x_{t+1}` with what re-scoring and learning from them needs (DPOK's
    replay buffer holds these; `DiffusionRollout.to_transitions` makes them)."""

    states: torch.Tensor = per_sample()
    """`[n, ...]` states `x_t` (the model's dtype and latent layout)."""
    next_states: torch.Tensor = per_sample()
    """`[n, ...]` the sampled next states `x_{t+1}`."""
    steps: torch.Tensor = per_sample()
    """`[n]` step indices t (long)."""
    prompts: torch.Tensor = per_sample()
    """`[n]` prompt indices (into a table the owner keeps)."""
    log_probs: torch.Tensor = per_sample()
    """`[n]` fp32 behaviour log-probabilities `log p_old(x_{t+1} | x_t, c)`."""
    rewards: torch.Tensor = per_sample()
    """`[n]` fp32 return of the trajectory the step belongs to (the reward or its advantage)."""
