"""Evaluating an image policy: held-out prompts, fixed noise, training rewards, gold metrics, diversity, grids.

Every evaluation samples `eval.samples_per_prompt` images per test prompt with the same noise (`eval.seed`)
and the deterministic sampler (ODE for flow models, eta-0 DDIM for UNets), so curves compare like with
like; it scores them with the training rewards and the `eval.metrics` (gold metrics the trainer never
optimises) and measures the within-prompt diversity (mean pairwise RMS pixel distance). With a validation prompt
set (`prompts.val`) it evaluates that set alike, as `val/...`: what `eval.best_metric` selects on, so that the test
set's numbers (`eval/...`) are never the ones a checkpoint was chosen by.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from flowrl.image.config import ImageEvalConfig, SamplingConfig
from flowrl.prompts import source_images
from flowrl.rewards import Rewards
from flowrl.runtime import Processes, row_generators
from flowrl.tracking import image_grid


class ImageEvaluator:
    """Evaluation of a `DiffusionPolicy` on held-out prompts.

    Args:
        policy (`DiffusionPolicy`): the policy (the trainer swaps in EMA weights and sets eval mode).
        rewards (`Rewards`): the training rewards (their weighted sum is `eval/reward`).
        metrics (`dict[str, Callable]`): gold metrics by name, never optimised.
        processes (`Processes`): evaluation prompts are sharded over the processes.
        test_prompts (`list`): the held-out prompt set (`eval/...`).
        val_prompts (`list`, *optional*): the validation prompt set (`val/...`), kept apart from the test set.
        eval_config, sampling (`ImageEvalConfig`, `SamplingConfig`): sizes, steps, guidance, seed.
        initial_latents (`Callable`, *optional*): `(texts, generator, height, width) -> latents` of the
            evaluation samples (FIND's noise policy); None: the policy draws them.
        autocast (`Callable`, *optional*): a context manager factory for mixed precision.
    """

    def __init__(
        self,
        *,
        policy,
        rewards: Rewards,
        metrics: dict[str, Callable],
        processes: Processes,
        test_prompts: list,
        eval_config: ImageEvalConfig,
        sampling: SamplingConfig,
        initial_latents: Callable | None = None,
        autocast: Callable | None = None,
        val_prompts: list | None = None,
    ):
        self.policy, self.rewards, self.metrics, self.processes = policy, rewards, metrics, processes
        self.test_prompts, self.config, self.sampling = test_prompts, eval_config, sampling
        self.val_prompts = val_prompts or []
        self.initial_latents = initial_latents
        self.autocast = autocast

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """`eval/<reward>`, `eval/<metric>`, `eval/reward` (the weighted training reward), `eval/diversity` (with
        `samples_per_prompt` >= 2) on the test prompts; the same as `val/...` on the validation prompts."""
        out = self._evaluate(self.test_prompts, "eval")
        if self.val_prompts:
            out.update(self._evaluate(self.val_prompts, "val"))
        return out

    def _evaluate(self, prompts: list, prefix: str) -> dict[str, float]:
        s, e = self.sampling, self.config
        prompts = prompts[: e.max_prompts] if e.max_prompts else prompts
        full = [p for p in prompts for _ in range(e.samples_per_prompt)]
        full_padded = full + full[: (-len(full)) % self.processes.world]
        local = self.processes.local_slice(len(full_padded))
        sampler = "ode" if self.policy.adapter.time_kind == "flow" else "ddim"
        generator = row_generators((e.seed,), range(local.start, local.stop))  # a sample's noise: its position
        guidance = s.guidance_scale if e.guidance_scale is None else e.guidance_scale
        texts = [str(p) for p in full_padded[local]]
        sources = source_images(full_padded[local])  # editing: the test prompts' source images
        with self.autocast() if self.autocast else nullcontext():
            latents = self.initial_latents(texts, generator, s.height, s.width) if self.initial_latents else None
            progress = f"{prefix} {len(full)} samples" if self.processes.is_main else None
            rollout = self.policy.rollout(
                texts,
                num_steps=e.num_steps or s.num_steps,
                guidance_scale=guidance,
                noise_level=0.0,
                sampler=sampler,
                generator=generator,
                height=s.height,
                width=s.width,
                latents=latents,
                progress=progress,
                source_images=sources,
            )
        fns = {**self.rewards.fns, **self.metrics}
        scored = self.rewards.score(rollout.images, full_padded[local], fns, sources=rollout.source_images)
        scores = {k: v[: len(full)] for k, v in scored.items()}
        # diversity on (at most) 64x64 thumbnails, so gathering large images stays cheap
        thumbs = rollout.images.float()
        if thumbs.shape[-1] > 64:  # videos [B, 3, F, H, W]: frame by frame
            size = (64, 64) if thumbs.ndim == 4 else (thumbs.shape[2], 64, 64)
            thumbs = torch.nn.functional.interpolate(thumbs, size=size, mode="area")
        images = self.processes.gather(thumbs)[: len(full)]
        out = {f"{prefix}/{name}": nanmean(v) for name, v in scores.items()}
        out[f"{prefix}/reward"] = nanmean(self.rewards.combined(scores))
        if e.samples_per_prompt >= 2:  # diversity is within a prompt's samples: none with one sample per prompt
            out[f"{prefix}/diversity"] = group_diversity(images, e.samples_per_prompt)
        return out


def nanmean(t: torch.Tensor) -> float:
    """Mean of the finite entries (NaN when there are none)."""
    finite = t[torch.isfinite(t)]
    return float(finite.mean()) if finite.numel() else float("nan")


def group_diversity(images: torch.Tensor, k: int) -> float:
    """Mean pairwise RMS pixel distance within each group of k consecutive samples (0 = identical samples)."""
    if k < 2:
        return float("nan")
    groups = images[: len(images) // k * k].flatten(1).reshape(-1, k, images[0].numel())
    d = torch.cdist(groups, groups) / math.sqrt(images[0].numel())  # [G, k, k]
    return float(d.sum((1, 2)).mean() / (k * (k - 1)))


def sample_grid(rollout, total: torch.Tensor, group_size: int, path: Path, title: str = "") -> torch.Tensor:
    """A PNG grid of up to 16 training samples (two per group) captioned with prompt and reward; returns them."""
    take = list(range(0, len(rollout), max(1, group_size // 2)))[:16]
    captions = [f"{rollout.prompts[i]} | r={total[i]:.3f}" for i in take]
    image_grid(rollout.images[take], captions, path, title=title)
    return rollout.images[take]
