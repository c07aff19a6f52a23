"""Sampling of a `DiffusionPolicy`: `rollout` records every denoising transition with its log-probability, under
any step kernel (`flowrl.policies.sde`), SDE window and post-window solver."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flowrl.core.copies import to_device
from flowrl.policies.diffusion_rollout import DiffusionRollout
from flowrl.policies.sde import SAMPLERS, dpm_solver_2m_step


FLOW_SAMPLERS = ("flow_sde", "dance_sde", "cps", "cps_gaussian", "ode")
POST_WINDOW_SOLVERS = ("euler", "dpm_solver_2m")
"""How the steps after the SDE window are integrated (`DiffusionPolicy.rollout`)."""


class RolloutSampling:
    """The sampling part of `DiffusionPolicy` (a mixin over `ChunkedCalls`)."""

    # ------------------------------------------------------------------------------------------
    # sampling
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def rollout(
        self,
        prompts: Sequence[str],
        *,
        num_steps: int = 10,
        guidance_scale: float = 4.5,
        noise_level: float = 0.7,
        sampler: str | None = None,
        sde_window: tuple[int, int] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        height: int | None = None,
        width: int | None = None,
        latents: torch.Tensor | None = None,
        decode: bool = True,
        store_means: bool = False,
        progress: str | None = None,
        post_window_solver: str = "euler",
        post_window_ratio: float = 0.4,
        source_images: Sequence | None = None,
        forward_batch_size: int | None = None,
    ) -> DiffusionRollout:
        """Sample one trajectory per prompt and record its per-step log-probabilities.

        Args:
            prompts (`Sequence[str]`): one per sample; repeat a prompt k times for a group of k.
            num_steps (`int`, defaults to 10): denoising steps T (Flow-GRPO trains with 10).
            guidance_scale (`float`, defaults to 4.5): classifier-free guidance (SD3, UNets; off at <= 1),
                or Flux's guidance embedding.
            noise_level (`float`, defaults to 0.7): the sampler's noise (`flow_sde` a, `dance_sde` eta,
                `cps` a, `ddim` eta).
            sampler (`str`, *optional*): `flow_sde` (default for flow models), `dance_sde`, `cps`,
                `cps_gaussian`, `ode`; `ddim` (default, eta = `noise_level`) or `ode` (eta 0) for UNets.
            sde_window (`tuple[int, int]`, *optional*): stochastic steps `start <= t < end`; the others are
                deterministic ODE / eta-0 DDIM steps (MixGRPO, Flow-GRPO-Fast). Default: every step.
            generator (`torch.Generator` or a list of one per prompt, *optional*): seeds the initial noise and every
                step's noise (with a list, row `i` draws from generator `i`, so a sample does not depend on the
                batch it is drawn in).
            height, width (`int`, *optional*): image size (default: the model's).
            latents (`torch.Tensor`, *optional*): initial noise `[B, C, h, w]` (e.g. from FIND's noise policy).
            decode (`bool`, defaults to `True`): decode the final latents to images.
            store_means (`bool`, defaults to `False`): keep each step's behaviour mean (GRPO-Guard).
            progress (`str`, *optional*): show a progress bar over the denoising steps with this label.
            post_window_solver (`str`, defaults to `"euler"`): the steps after `sde_window`: `euler` (the ODE on
                the same grid) or `dpm_solver_2m` (MixGRPO-Flash: the `T - end` steps re-discretised to
                `max(int((T - end + 1) * post_window_ratio), 2) - 1` and integrated with DPM-Solver++(2M); the
                rollout then has fewer steps, and its `sigmas`/`timesteps` are the grid it ran on).
            post_window_ratio (`float`, defaults to 0.4): the compression of `dpm_solver_2m` (Flash 0.4, Flash* 0.2).
            source_images (`Sequence`, *optional*): editing models: one entry per prompt, each a path, PIL image or
                `[3, H, W]` tensor in [0, 1], or a sequence of them (`flowrl.policies.sources`); the sample is
                conditioned on its (prompt, source images) pair and the rollout keeps the pairs (`edit_ids`).
            forward_batch_size (`int`, *optional*): rows per network call in this rollout (default: the policy's);
                `rescore` then makes its log-probs those of calls of the policy's size.
        """
        prompts = list(prompts)
        if not prompts:
            raise ValueError("rollout needs at least one prompt")
        sampler = sampler or self.adapter.default_sampler
        valid = ("ddim", "ode") if self.adapter.time_kind == "ddim" else FLOW_SAMPLERS
        if sampler not in valid:
            raise ValueError(f"sampler {sampler!r} does not fit a {self.family} model; choose from {', '.join(valid)}")
        SAMPLERS.get(sampler)
        start, end = sde_window if sde_window is not None else (0, num_steps)
        if not 0 <= start < end <= num_steps:
            raise ValueError(f"sde_window must satisfy 0 <= start < end <= num_steps={num_steps}, got {sde_window}")

        batch = len(prompts)
        chunk = forward_batch_size or self.forward_batch_size or batch
        unique = list(dict.fromkeys(prompts))
        prompt_ids = torch.tensor([unique.index(p) for p in prompts])
        cfg = self.adapter.uses_cfg(guidance_scale)
        self.encode(unique + [self.negative_prompt] if cfg else unique)  # one pass over the text encoders
        unique_cond = self.encode(unique)
        cond = {k: v[to_device(prompt_ids, v.device)] for k, v in unique_cond.items()}  # host ids
        default_h, default_w = self.adapter.default_size()
        height, width = height or default_h, width or default_w
        edits = None if source_images is None else self.encode_edits(prompts, source_images, (height, width))
        if edits is not None:  # each row's (prompt, conditioning images) conditioning beside its prompt's
            cond.update({k: v[edits.ids.to(v.device)] for k, v in edits.cond.items()})
        null_cond = self.encode([self.negative_prompt], negative=True) if cfg else None
        plan = self._plan(batch, chunk, cond, null_cond)

        static = self.adapter.static_inputs(height, width)
        if latents is None:
            x = self.adapter.initial_latents(batch, height, width, generator)
        else:
            if latents.shape[0] != batch:
                raise ValueError(f"latents has {latents.shape[0]} rows for {batch} prompts")
            x = latents.to(device=self.device, dtype=self.dtype)
        x = self.adapter.place_conditions(x, cond)  # image-to-video: the start frame's latent, where the state has it
        timesteps, sigmas = self.adapter.schedule(num_steps, x.shape)
        if len(timesteps) != num_steps:
            raise ValueError(f"the scheduler produced {len(timesteps)} steps for num_steps={num_steps}")
        if post_window_solver not in POST_WINDOW_SOLVERS:
            raise ValueError(
                f"post_window_solver must be one of {', '.join(POST_WINDOW_SOLVERS)}, got {post_window_solver!r}"
            )
        multistep = post_window_solver == "dpm_solver_2m" and end < num_steps
        if multistep:
            timesteps, sigmas = self._after_window(timesteps, sigmas, end, post_window_ratio, x.shape)
            num_steps = len(timesteps)

        stochastic = sampler != "ode" and not (sampler == "ddim" and noise_level == 0)
        sde_mask = torch.zeros(num_steps, dtype=torch.bool)
        sde_mask[start:end] = stochastic
        states, log_probs, stds, means = [x], [], [], []
        x0_prev = None  # the previous step's data prediction, for the multistep solver after the window
        for i in _steps(num_steps, progress):
            kind = sampler if sde_mask[i] else "ode"  # "ode" is eta-0 DDIM for UNets
            noise = None
            if kind != "ode":
                noise = _noise(x.shape, generator, x.device)
            step = torch.full((batch,), i, dtype=torch.long)
            predictions = [] if multistep and i >= end - 1 else None
            out = self._run(
                self.model,
                kind,
                x,
                step,
                plan,
                cfg=cfg,
                static=static,
                sigmas=sigmas,
                timesteps=timesteps,
                guidance_scale=guidance_scale,
                noise_level=noise_level,
                noise=noise,
                predictions=predictions,
            )
            if predictions is not None:
                v = torch.cat(predictions)
                if i >= end:  # replaces the Euler step just computed (a few element-wise ops; the call is shared)
                    out = dpm_solver_2m_step(v, sigmas[i], sigmas[i + 1], x, x0_prev=x0_prev, sigma_prev=sigmas[i - 1])
                x0_prev = x.float() - float(sigmas[i]) * v.float()  # the schedule is host data: no sync
            x = out.prev_sample
            states.append(x)
            log_probs.append(out.log_prob)
            stds.append(self._host_std(kind, i, sigmas, timesteps, noise_level))
            if store_means:
                means.append(out.mean)

        # a step whose kernel has no spread (CPS ends at s' = 0) has no density: it is deterministic, not trained
        sde_mask &= torch.stack(stds) > 0
        return DiffusionRollout(
            prompts=prompts,
            prompt_ids=prompt_ids,
            unique_prompts=unique,
            latents=torch.stack(states, dim=1),
            log_probs=torch.stack(log_probs, dim=1),
            sde_mask=sde_mask,
            timesteps=timesteps,
            sigmas=sigmas,
            stds=torch.stack(stds),
            cond=unique_cond,
            null_cond=null_cond,
            sampler=sampler,
            noise_level=noise_level,
            guidance_scale=guidance_scale,
            forward_batch_size=chunk,
            reduce=self.reduce,
            height=height,
            width=width,
            static=static,
            images=self.decode(x, height, width, chunk) if decode else None,
            means=torch.stack(means, dim=1) if store_means else None,
            **({} if edits is None else edits.rollout_fields()),
        )

    def decode(self, latents: torch.Tensor, height: int, width: int, chunk: int | None = None) -> torch.Tensor:
        """Images (videos) of `latents`, decoded `chunk` rows at a time (the last chunk padded like the network's
        calls), so a rollout's decoder memory is one chunk's whatever the batch."""
        n = len(latents)
        chunk = min(chunk or n, n)
        if chunk == n:
            return self.adapter.decode(latents, height, width)
        parts = []
        for start in range(0, n, chunk):
            rows = latents[start : start + chunk]
            real = len(rows)
            if real < chunk:
                rows = torch.cat([rows, rows[:1].expand(chunk - real, *rows.shape[1:])])
            parts.append(self.adapter.decode(rows, height, width)[:real])
        return torch.cat(parts)

    def _host_std(self, kind: str, i: int, sigmas, timesteps, noise_level: float) -> torch.Tensor:
        """The std of step `i`'s kernel, computed on the host (it depends on the schedule, not on the network's
        output), so a rollout never reads a device value back."""
        dummy = torch.zeros(1, 1)
        step = torch.tensor([i])
        out = self._kernel(
            kind, dummy, step, sigmas, timesteps, dummy, prev_sample=dummy, noise=None, noise_level=noise_level
        )
        return out.std[0]

    def _after_window(self, timesteps, sigmas, end: int, ratio: float, latent_shape):
        """MixGRPO-Flash's grid: the first `end` steps as scheduled, then `sigmas[end] -> 0` in
        `max(int((T - end + 1) * ratio), 2) - 1` steps uniform in unshifted time (`ModelAdapter.resample_sigmas`;
        MixGRPO keeps `int((T - end + 1) * ratio)` points, which never reach 0 when that is 1)."""
        if not 0 < ratio <= 1:
            raise ValueError(f"post_window_ratio must be in (0, 1], got {ratio}")
        num_steps = len(timesteps)
        intervals = max(int((num_steps - end + 1) * ratio), 2) - 1
        post = self.adapter.resample_sigmas(float(sigmas[end]), intervals, latent_shape).to(sigmas)
        scale = self.adapter.scheduler.config.num_train_timesteps  # flow timesteps are sigma * 1000
        post_t = (post[:-1] * scale).to(device=timesteps.device, dtype=timesteps.dtype)
        return torch.cat([timesteps[:end], post_t]), torch.cat([sigmas[:end], post])


def _steps(num_steps: int, label: str | None):
    """`range(num_steps)`, with a transient progress bar when `label` is given."""
    if label is None:
        return range(num_steps)
    from tqdm.auto import tqdm

    return tqdm(range(num_steps), desc=label, unit="step", leave=False)


def _noise(shape, generator, device: torch.device) -> torch.Tensor:
    """fp32 standard normal noise of `shape` as diffusers' `randn_tensor` draws it (row `i` from generator `i`, on the
    generators' device: a run's CPU generators give the same noise on any device), copied to `device` without
    waiting for it: `randn_tensor` copies a CPU draw to the GPU with a blocking copy, which waits for every queued
    kernel at each stochastic step; a pinned buffer and a non-blocking copy queue it behind them instead."""
    first = generator[0] if isinstance(generator, (list, tuple)) else generator
    where = first.device if first is not None else device
    from diffusers.utils.torch_utils import randn_tensor  # here: importing diffusers costs 2 s

    noise = randn_tensor(shape, generator=generator, device=where, dtype=torch.float32)
    if noise.device == device:
        return noise
    if device.type == "cuda":
        noise = noise.pin_memory()
    return to_device(noise, device)
