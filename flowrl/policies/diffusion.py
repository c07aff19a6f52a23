"""`DiffusionPolicy`: a diffusers model as a policy with per-step log-probabilities.

`rollout(prompts, ...)` samples images and records every denoising transition with its log-probability;
`score(rollout, steps)` re-scores stored transitions under the current weights (or the reference's) with the
same guidance, which is what every trainer differentiates.

Exactness: a network's output for one sample can differ in the last bits with the batch it is computed in
(different GEMM shapes pick different kernels; the anchors' most reported "ratio != 1" bug). The policy
therefore runs every forward and step kernel on chunks of exactly `forward_batch_size` rows, padding the
last chunk, so every call has the same shapes: re-scoring a rollout's chunks as sampled reproduces its
log-probs bit for bit on any CPU or GPU. A sample re-scored at another position of a chunk (a shuffled
minibatch) reproduces them bit for bit where the kernels do not depend on the row position (the digits
world and the tiny SD3/Flux models on the machines tested) and to the last bits otherwise (some MKL/AVX2
kernels), far inside any clip range.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from flowrl.core.copies import to_device
from flowrl.models.adapter import CallableAdapter, ModelAdapter
from flowrl.policies.calls import ChunkedCalls
from flowrl.policies.diffusion_rollout import DiffusionRollout, Transitions
from flowrl.policies.sampling import FLOW_SAMPLERS, POST_WINDOW_SOLVERS, RolloutSampling
from flowrl.policies.sde import StepOutput
from flowrl.policies.sources import SourceConditioning
from flowrl.policies.weights import PolicyWeights


__all__ = [
    "DiffusionPolicy",
    "DiffusionRollout",
    "FLOW_SAMPLERS",
    "POST_WINDOW_SOLVERS",
    "Transitions",
    "from_callable",
]


class DiffusionPolicy(PolicyWeights, ChunkedCalls, SourceConditioning, RolloutSampling):
    """A text-to-image diffusion / flow model as a policy over denoising steps.

    Its parts: the weights (`flowrl.policies.weights`: LoRA, the reference), the chunked network calls
    (`flowrl.policies.calls`), sampling (`flowrl.policies.sampling`: `rollout`) and, here, re-scoring.

    Args:
        adapter (`ModelAdapter`): how to call the model family (`flowrl.models.adapter`); use
            `DiffusionPolicy.from_pipeline(pipe)` for SD3/3.5, Flux.1 and SD1.x/2.x pipelines.
        forward_batch_size (`int`, *optional*): rows per network forward. `None` uses the rollout's batch
            size. Rollouts and re-scoring use the same chunking, padded, so log-probs reproduce exactly.
        reduce (`str`, defaults to `"mean"`): log-prob reduction over latent elements (`"mean"` or `"sum"`).
        negative_prompt (`str`, defaults to `""`): the unconditional branch of classifier-free guidance.
        text_batch_size (`int`, defaults to 8): prompts per text-encoder call (fixed and padded, so an
            embedding never depends on its batch).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        *,
        forward_batch_size: int | None = None,
        reduce: str = "mean",
        negative_prompt: str = "",
        text_batch_size: int = 8,
    ):
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        if forward_batch_size is not None and forward_batch_size < 1:
            raise ValueError(f"forward_batch_size must be >= 1, got {forward_batch_size}")
        self.adapter = adapter
        self.forward_batch_size = forward_batch_size
        self.reduce = reduce
        self.negative_prompt = negative_prompt
        self.text_batch_size = text_batch_size
        self.reference_model: torch.nn.Module | None = None
        self.reference_offload = False  # the reference copy lives in CPU memory between its passes
        self.forward_module: torch.nn.Module | None = None
        """What training forwards call (a trainer sets the accelerate/DDP-prepared module); default `model`."""
        self._text_cache: dict[str, dict[str, torch.Tensor]] = {}
        self._source_cache: dict[str, tuple] = {}
        """Editing: (prompt, source images) pair -> (prepared images, conditioning) (`flowrl.policies.sources`)."""

    @classmethod
    def from_pipeline(
        cls, pipeline, *, options: dict | None = None, max_sequence_length: int | None = None, **kwargs
    ) -> DiffusionPolicy:
        """Wrap a pipeline of a registered family (components shared) with the family's `options`
        (`model.options`; `max_sequence_length` is a shorthand for that option)."""
        options = dict(options or {})
        if max_sequence_length is not None:
            options["max_sequence_length"] = max_sequence_length
        from flowrl.models.families import adapter_for

        return cls(adapter_for(pipeline, options=options), **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype=torch.float32,
        device="cpu",
        family=None,
        options: dict | None = None,
        max_sequence_length: int | None = None,
        **kwargs,
    ) -> DiffusionPolicy:
        """Load a pipeline from a hub id or local folder (see `flowrl.models.load_pipeline`) and wrap it."""
        from flowrl.models.loaders import load_pipeline

        pipe = load_pipeline(name_or_path, dtype=dtype, device=device, family=family)
        return cls.from_pipeline(pipe, options=options, max_sequence_length=max_sequence_length, **kwargs)

    # ------------------------------------------------------------------------------------------
    # model access
    # ------------------------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The trainable network (transformer or UNet)."""
        return self.adapter.model

    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.dtype

    # ------------------------------------------------------------------------------------------
    # re-scoring
    # ------------------------------------------------------------------------------------------

    def score(self, rollout: DiffusionRollout, steps, *, reference: bool = False) -> StepOutput:
        """Re-score stored transitions `x_t -> x_{t+1}` under the current weights (or the reference's).

        Args:
            rollout (`DiffusionRollout`): from `rollout()` (possibly `select`-ed).
            steps: step indices: an `int` (that step for every sample), `[B]` (one step per sample) or
                `[B, k]` (k steps per sample). Each must be a stochastic step of the rollout.
            reference (`bool`, defaults to `False`): score under the reference policy (no gradient).

        Returns:
            `StepOutput` with `log_prob [B, k]`, `mean [B, k, C, h, w]`, `std [B, k]` and the stored next
            states as `prev_sample`; `log_prob` and `mean` carry the gradient of the network.
        """
        index = self._step_index(rollout, steps)
        rows = torch.arange(len(rollout), device=rollout.latents.device)
        cond = rollout.sample_cond()  # the prompt's text conditioning (and, editing, its source images')
        columns = []
        for j in range(index.shape[1]):
            step = index[:, j]
            dev = to_device(step, rollout.latents.device)
            states, next_states = rollout.latents[rows, dev], rollout.latents[rows, dev + 1]
            columns.append(self.score_transitions(rollout, states, next_states, step, cond, reference=reference))
        if len(columns) == 1:
            return StepOutput(*(t.unsqueeze(1) for t in columns[0]))
        return StepOutput(*(torch.stack(parts, dim=1) for parts in zip(*columns)))

    def score_transitions(
        self,
        rollout: DiffusionRollout,
        states: torch.Tensor,
        next_states: torch.Tensor,
        steps,
        cond: dict[str, torch.Tensor],
        *,
        reference: bool = False,
        return_prediction: bool = False,
    ):
        """Re-score single transitions `states -> next_states` that are not whole trajectories (replay buffers).

        The transitions must come from rollouts sampled like `rollout` (same sampler, noise level, guidance,
        number of steps and image size, hence the same schedule); `rollout` supplies those settings, the
        negative prompt's conditioning and the forward chunk size. Rows are scored in chunks of exactly
        `rollout.forward_batch_size`, as at rollout, so an unchanged policy reproduces the stored log-probs
        (see the module docstring on exactness; `score` is this function applied to a rollout's own rows).

        Args:
            rollout (`DiffusionRollout`): any rollout sampled with the transitions' settings.
            states, next_states (`torch.Tensor`): `[n, ...]` states `x_t` and the sampled `x_{t+1}`.
            steps: `[n]` step indices `t` (or an `int`); each must be a stochastic step of `rollout`.
            cond (`dict[str, torch.Tensor]`): per-row conditioning `[n, ...]` (`policy.encode(prompts)`).
            reference (`bool`, defaults to `False`): score under the reference policy (no gradient).
            return_prediction (`bool`, defaults to `False`): also return the network's (CFG-combined)
                prediction `[n, ...]` (noise for UNets, velocity for flow models).

        Returns:
            `StepOutput` with `log_prob [n]`, `mean [n, ...]`, `std [n]` and `next_states` as `prev_sample`;
            with `return_prediction`, `(StepOutput, prediction)`.
        """
        n = len(states)
        step = torch.as_tensor(steps, dtype=torch.long).cpu()
        step = step.expand(n) if step.ndim == 0 else step
        if step.shape != (n,) or len(next_states) != n:
            raise ValueError(f"steps and next_states must have one entry per state ({n}); got {tuple(step.shape)}")
        if ((step < 0) | (step >= rollout.num_steps)).any():
            raise ValueError(f"step indices must lie in [0, {rollout.num_steps}), got {step.unique().tolist()}")
        if not bool(rollout.sde_mask[step].all()):
            bad = sorted(set(step[~rollout.sde_mask[step]].tolist()))
            raise ValueError(f"steps {bad} were sampled deterministically (outside the SDE window); nothing to score")
        cfg = rollout.null_cond is not None
        plan = self._plan(n, rollout.forward_batch_size, cond, rollout.null_cond)
        predictions = [] if return_prediction else None
        with self._scoring_model(reference) as model:
            out = self._run(
                model,
                rollout.sampler,
                states,
                step,
                plan,
                cfg=cfg,
                static=rollout.static,
                sigmas=rollout.sigmas,
                timesteps=rollout.timesteps,
                guidance_scale=rollout.guidance_scale,
                noise_level=rollout.noise_level,
                prev_sample=next_states,
                predictions=predictions,
            )
        if not return_prediction:
            return out
        return out, predictions[0] if len(predictions) == 1 else torch.cat(predictions)

    @torch.no_grad()
    def rescore(self, rollout: DiffusionRollout, forward_batch_size: int | None = None) -> DiffusionRollout:
        """`rollout` with its stochastic steps' log-probs (and stored behaviour means) re-scored in calls of
        `forward_batch_size` rows (default: the policy's), the size training forwards use, so the ratio is exactly 1
        at the old weights however many rows the rollout's own calls had (a forward per stochastic step, no
        gradient); a rollout sampled at that size is returned as it is."""
        size = forward_batch_size or self.forward_batch_size
        if size is None or size == rollout.forward_batch_size or not rollout.sde_mask.any():
            return rollout
        resized = replace(rollout, forward_batch_size=size)
        if rollout.stochastic_step is not None:  # each sample has its own stochastic step (TempFlow-GRPO)
            index = rollout.stochastic_step.cpu()[:, None]
        else:
            index = rollout.sde_steps.expand(len(rollout), -1)
        out = self.score(resized, index)  # [B, k] log-probs, [B, k, ...] means
        rows = torch.arange(len(rollout))[:, None].expand_as(index)
        dev = rollout.log_probs.device
        log_probs = rollout.log_probs.clone()
        log_probs[to_device(rows, dev), to_device(index, dev)] = out.log_prob.to(log_probs)
        means = rollout.means
        if means is not None:
            means = means.clone()
            means[to_device(rows, means.device), to_device(index, means.device)] = out.mean.to(means)
        return replace(resized, log_probs=log_probs, means=means)

    def velocity_fn(
        self,
        rollout: DiffusionRollout,
        num_draws: int,
        *,
        guidance_scale: float | None = None,
        reference: bool = False,
    ):
        """A `velocity_fn(x_tau [B * N, C, h, w], tau [B * N])` over the rollout's prompts for FPO.

        Rows are sample-major (`flowrl.policies.fpo`). `tau` is the flow noise level; the network sees
        `tau * num_train_timesteps`. The conditional velocity is used (`guidance_scale` 1) unless
        `guidance_scale` is given; Flux keeps the rollout's guidance embedding. Forwards run in chunks of
        `rollout.forward_batch_size * num_draws` rows, so the losses stored at rollout reproduce exactly.
        Training calls go through `forward_module` (the accelerate/DDP-prepared network); `reference=True`
        gives the reference policy's velocity (no gradient).
        """
        if self.adapter.time_kind != "flow":
            raise ValueError(f"FPO needs a velocity model; a {self.family} model predicts noise")
        if guidance_scale is None:
            guidance_scale = 1.0 if self.adapter.uses_cfg(rollout.guidance_scale) else rollout.guidance_scale
        ids = rollout.prompt_ids.repeat_interleave(num_draws)
        cond = rollout.sample_cond(repeat=num_draws)
        cfg = self.adapter.uses_cfg(guidance_scale)
        null_cond = self.encode([self.negative_prompt], negative=True) if cfg else None
        plan = self._plan(len(ids), rollout.forward_batch_size * num_draws, cond, null_cond)
        scale = float(self.adapter.scheduler.config.num_train_timesteps)

        def velocity(x, tau):
            parts = []
            with self._scoring_model(reference) as model:
                for chunk in plan:
                    rows = slice(None) if chunk.rows is None else chunk.rows.to(x.device)
                    host = (tau[rows] * scale) if tau.device.type == "cpu" else None
                    t = to_device(tau[rows] * scale, x.device)
                    out = self._predict(model, x[rows], t, chunk.cond, cfg, guidance_scale, rollout.static, host=host)
                    parts.append(out[: chunk.real])
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return velocity

    def log_prob(self, rollout: DiffusionRollout, steps, *, reference: bool = False) -> torch.Tensor:
        """`[B, k]` log-probabilities of the stored transitions at `steps` (see `score`)."""
        return self.score(rollout, steps, reference=reference).log_prob

    @contextmanager
    def _scoring_model(self, reference: bool):
        if not reference:
            yield self.forward_module if self.forward_module is not None else self.model
            return
        with torch.no_grad(), self.reference() as model:
            yield model

    @staticmethod
    def _step_index(rollout: DiffusionRollout, steps) -> torch.Tensor:
        b, t = len(rollout), rollout.num_steps
        index = torch.as_tensor(steps, dtype=torch.long).cpu()
        if index.ndim == 0:
            index = index.expand(b, 1)
        elif index.ndim == 1:
            index = index.unsqueeze(1)
        if index.ndim != 2 or index.shape[0] != b:
            raise ValueError(f"steps must be an int, [B] or [B, k] with B={b}; got shape {tuple(index.shape)}")
        if ((index < 0) | (index >= t)).any():
            raise ValueError(f"step indices must lie in [0, {t}), got {index.unique().tolist()}")
        return index.contiguous()


def from_callable(model, encode, decode, latent_shape, scheduler, *, encode_images=None, **kwargs) -> DiffusionPolicy:
    """A policy over any SD3-convention velocity network with callable text encoder and decoder (and, optionally,
    image encoder: `CallableAdapter`)."""
    adapter = CallableAdapter(model, encode, decode, latent_shape, scheduler, encode_images=encode_images)
    return DiffusionPolicy(adapter, **kwargs)
