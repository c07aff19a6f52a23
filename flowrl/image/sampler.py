"""One sampling call of the image modality: the policy's samples of some of the epoch's prompts.

`ImageSampler(texts, generators, rows, epoch)` samples `texts` (at positions `rows` of the epoch's prompt list, one
seeded generator per sample) with the configured sampler and this epoch's SDE window. Algorithms that sample
differently wrap or subclass it (FIND starts from its noise policy, DiffusionNFT samples with its old weights,
TempFlow-GRPO branches off ODE trunks); the collector only calls it.
"""

from __future__ import annotations

import torch

from flowrl.core import sde_window_at
from flowrl.image.config import SamplingConfig
from flowrl.policies.diffusion import DiffusionRollout
from flowrl.runtime import seeded


class ImageSampler:
    """See the module docstring.

    Args:
        policy (`DiffusionPolicy`): the policy.
        sampling (`SamplingConfig`): the sampler and its settings.
        seed (`int`): `run.seed` (SDE windows and group noise are drawn from it per epoch).
        group_size (`int`): samples per prompt (`prompts.group_size`).
        autocast (`Callable`): mixed-precision context factory.
        store_means (`bool`): keep each step's behaviour mean (GRPO-Guard's RatioNorm).
        requires_stochastic (`bool`): refuse rollouts without a stochastic step (log-ratio trainers).
    """

    def __init__(
        self,
        policy,
        sampling: SamplingConfig,
        *,
        seed: int,
        group_size: int,
        autocast,
        store_means: bool = False,
        requires_stochastic: bool = True,
    ):
        self.policy, self.sampling, self.seed, self.group_size = policy, sampling, seed, group_size
        self.autocast, self.store_means, self.requires_stochastic = autocast, store_means, requires_stochastic

    def __call__(self, texts: list[str], generators, rows, epoch: int, sources=None) -> DiffusionRollout:
        """Sample `texts` (editing: each with its `sources`, the prompts' source images)."""
        s = self.sampling
        latents = self.group_noise(rows, epoch) if s.init_same_noise else None
        with self.autocast():
            rollout = self.policy.rollout(
                texts,
                num_steps=s.num_steps,
                guidance_scale=s.guidance_scale,
                noise_level=s.noise_level,
                sampler=s.sampler,
                sde_window=self.window(epoch),
                latents=latents,
                generator=generators,
                height=s.height,
                width=s.width,
                store_means=self.store_means,
                post_window_solver=s.post_window_solver,
                post_window_ratio=s.post_window_ratio,
                source_images=sources,
                forward_batch_size=s.forward_batch_size,
            )
            rollout = self.policy.rescore(rollout)  # at the training calls' size (`sampling.forward_batch_size`)
        if self.requires_stochastic and not rollout.sde_mask.any():
            raise ValueError(f"sampler {s.sampler!r} with noise_level {s.noise_level} has no stochastic step to train")
        return rollout

    def window(self, epoch: int) -> tuple[int, int] | None:
        """The stochastic steps of epoch `epoch`'s rollouts (`sampling.sde_window_schedule`), the same on every
        process and on resume."""
        s = self.sampling
        generator = seeded(self.seed, epoch, 7)
        return sde_window_at(
            s.sde_window_schedule,
            epoch,
            s.num_steps,
            window=s.sde_window,
            size=s.window_size,
            every=s.window_every,
            stride=s.window_stride,
            span=s.window_span,
            generator=generator,
        )

    def group_noise(self, rows, epoch: int, per_group: int = 1) -> torch.Tensor:
        """Initial latents `[len(rows), ...]` shared within each group of the epoch's prompt list (MixGRPO's and
        DanceGRPO's `--init_same_noise`): `per_group` draws per group (TempFlow-GRPO's seeds), draw `d` of group
        `g` seeded by `(seed, epoch, 8, g, d)`, so every process and a resumed run start from the same noise.
        Sample `i` of a group of `k` takes draw `i * per_group // k`."""
        k, s = self.group_size, self.sampling
        adapter = self.policy.adapter
        default_h, default_w = adapter.default_size()
        height, width = s.height or default_h, s.width or default_w
        noises = {}
        for row in rows:
            key = (row // k, (row % k) * per_group // k)
            if key not in noises:
                noises[key] = adapter.initial_latents(1, height, width, seeded(self.seed, epoch, 8, *key))
        return torch.cat([noises[(row // k, (row % k) * per_group // k)] for row in rows])
