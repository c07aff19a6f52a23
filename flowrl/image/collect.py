"""Collecting an epoch of images: prompts, sharded sampling, rewards scored (overlapped with sampling).

`ImageCollector` is the image modality's collector: the epoch's m x k prompts (the same list on every process,
drawn from `(seed, epoch)`), this process's contiguous share sampled by an `ImageSampler` (or an algorithm's own
sampler), optionally in parts whose rewards are scored on threads while the next part samples. It returns a typed
`Collected` batch and never calls into the trainer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flowrl.policies.diffusion import DiffusionRollout
from flowrl.policies.rollout import Collected
from flowrl.prompts import epoch_prompts, source_images
from flowrl.rewards import RewardExecutor, Rewards
from flowrl.rewards.scoring import call_reward, source_kwargs, texts_and_metadata
from flowrl.runtime import Processes, row_generators


class ImageCollector:
    """An epoch of images and their rewards.

    Args:
        sampler (`Callable`): `sampler(texts, generators, rows, epoch) -> DiffusionRollout`: one sampling call;
            `generators` has one generator per text, `rows` are the samples' positions in the epoch's prompt list
            (sample `i` of a group of `k` is `rows % k`), the same on every process.
        rewards (`Rewards`): the training rewards.
        processes (`Processes`): this process's share.
        train_prompts (`list`): the training prompt set (`flowrl.prompts.Prompt`s).
        prompts_per_epoch, group_size (`int`): m distinct prompts per epoch, k samples each.
        seed (`int`): `run.seed`.
        reward_overlap (`int`): sample in this many parts, scoring each finished part while the next samples.
        memory (`PeakMemory`, *optional*): measures the rollout and scoring phases.
    """

    def __init__(
        self,
        *,
        sampler: Callable,
        rewards: Rewards,
        processes: Processes,
        train_prompts: list,
        prompts_per_epoch: int,
        group_size: int,
        seed: int,
        reward_overlap: int = 1,
        memory=None,
    ):
        if not train_prompts:
            raise ValueError("the training prompt set is empty")
        self.sampler, self.rewards, self.processes = sampler, rewards, processes
        self.train_prompts, self.m, self.k = train_prompts, prompts_per_epoch, group_size
        self.seed, self.reward_overlap, self.memory = seed, reward_overlap, memory

    def epoch_prompts(self, epoch: int) -> list:
        """This epoch's m prompts, each repeated k times (the same list on every process)."""
        return epoch_prompts(self.train_prompts, self.m, self.k, self.seed, epoch)

    def sample(self, epoch: int, on_part=None) -> tuple[DiffusionRollout, list, slice]:
        """Rollout of this process's share of the epoch's prompts; returns `(rollout, prompts, local)`.

        The share is sampled in `reward_overlap` parts and `on_part(part, part_prompts)` runs after each. Each
        sample's noise comes from its own generator, seeded by its position in the epoch's prompt list, so a
        sample is the same on one process or many and with any `reward_overlap`.
        """
        prompts = self.epoch_prompts(epoch)
        local = self.processes.local_slice(len(prompts))
        mine = prompts[local]
        n = min(self.reward_overlap, len(mine))
        bounds = [len(mine) * i // n for i in range(n + 1)]
        parts = []
        for i in range(n):
            rows = slice(bounds[i], bounds[i + 1])
            positions = range(local.start + rows.start, local.start + rows.stop)
            generators = row_generators((self.seed, epoch, 2), positions)
            sources = source_images(mine[rows])  # editing: the prompts' source images (None: text-to-image)
            extra = {} if sources is None else {"sources": sources}
            part = self.sampler([str(p) for p in mine[rows]], generators, positions, epoch, **extra)
            if on_part is not None:
                on_part(part, mine[rows])
            parts.append(part)
        rollout = parts[0] if n == 1 else DiffusionRollout.cat(parts)
        return rollout, prompts, local

    def collect(self, epoch: int) -> Collected:
        """`sample` and the gathered rewards of its images, scored while sampling when `reward_overlap` > 1."""
        start = time.time()
        mark = self.memory.mark if self.memory else lambda phase: {}
        if self.reward_overlap == 1:
            rollout, prompts, local = self.sample(epoch)
            memory = mark("rollout")  # on a GPU: after the rollout's kernels finished (the mark waits for them)
            sampled = time.time()
            rewards = self.rewards.score(rollout.images, prompts[local], sources=rollout.source_images)
            memory.update(mark("scoring"))
        else:  # sampling and scoring overlap: one measurement for both
            rollout, prompts, local, rewards, sampled = self._collect_overlapped(epoch)
            memory = mark("rollout_and_scoring")
        times = {"time/sample_s": sampled - start, "time/reward_s": time.time() - sampled, **memory}
        return Collected(
            data=rollout,
            rows=torch.arange(local.start, local.stop),
            size=len(prompts),
            prompts=prompts,
            rewards=rewards,
            total=self.rewards.combined(rewards),
            times=times,
        )

    def _collect_overlapped(self, epoch: int):
        """`sample` in parts, each part's rewards scored on one thread per reward while later parts sample."""
        executors = {name: RewardExecutor(fn, max_workers=1) for name, fn in self.rewards.fns.items()}
        pending = []  # (rows in the part, {name: Future})

        def submit(part, part_prompts):
            texts, metadata = texts_and_metadata(part_prompts)
            pending.append(
                (
                    len(texts),
                    {
                        name: ex.submit(
                            part.images, texts, **metadata, **source_kwargs(self.rewards.fns[name], part.source_images)
                        )
                        for name, ex in executors.items()
                    },
                )
            )

        try:
            rollout, prompts, local = self.sample(epoch, on_part=submit)
            sampled = time.time()
            local_scores = {
                name: torch.cat([call_reward(name, futures[name].result, rows) for rows, futures in pending])
                for name in executors
            }
        finally:
            for ex in executors.values():
                ex.shutdown(wait=True)
        rewards = {name: self.processes.gather(v) for name, v in local_scores.items()}
        return rollout, prompts, local, rewards, sampled
