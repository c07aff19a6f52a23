"""The network calls of a `DiffusionPolicy`: text conditioning cached per prompt, and every forward and step kernel
on chunks of exactly `forward_batch_size` rows (padded), so a rollout's log-probs re-score bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from flowrl.core.copies import to_device
from flowrl.policies.sde import StepOutput, ddim_step, sde_step
from flowrl.policies.sources import NEGATIVE
from flowrl.policies.text_store import TextStore, encoders_on, offload_encoders, text_encoders


@dataclass
class _Chunk:
    rows: torch.Tensor | None
    """Row indices (padded to the chunk size), or `None` when the chunk is the whole batch in order."""
    real: int
    """How many of the rows are real (the rest is padding)."""
    cond: dict
    """The chunk's conditioning, with the unconditional branch prepended under CFG."""


def _unconditional(key: str, value: torch.Tensor, cond: dict, null_cond: dict, size: int) -> torch.Tensor:
    """The unconditional branch's `[size, ...]` for one conditioning key: the pair's own negative conditioning
    (`negative:<key>`, when the negative prompt sees the source images), else the negative prompt's, else (a source
    image's latents) the same as the conditional branch's."""
    if NEGATIVE + key in cond:
        return cond[NEGATIVE + key]
    return null_cond[key].expand(size, *value.shape[1:]) if key in null_cond else value


def _partly_ode(kind, fixed, output, sigma, sigma_next, sample, *, prev_sample, noise, **kwargs) -> StepOutput:
    """The step `kind` on the elements outside `fixed` (`[...]`, a host bool mask over one sample's elements) and the
    ODE on those inside: noise, log-probability (reduced over the free elements only), mean and std are the free
    elements' (`mean [n, k]`, in the row-major order a boolean mask gives), the next state is the whole state. The
    mask becomes index lists on the host, so no step reads the device (a device mask's indexing would)."""
    mask = fixed.reshape(-1).cpu()
    free = (~mask).nonzero().squeeze(1).to(sample.device, non_blocking=True)
    held = mask.nonzero().squeeze(1).to(sample.device, non_blocking=True)

    def take(t, index):
        return t.flatten(1).index_select(1, index)

    noise = None if noise is None else take(noise, free)
    given = None if prev_sample is None else take(prev_sample, free)
    out = sde_step(
        kind, take(output, free), sigma, sigma_next, take(sample, free), noise=noise, prev_sample=given, **kwargs
    )
    if prev_sample is None:
        prev_sample = torch.empty_like(sample)
        flat = prev_sample.view(len(sample), -1)
        flat.index_copy_(1, free, out.prev_sample)
        flat.index_copy_(
            1, held, sde_step("ode", take(output, held), sigma, sigma_next, take(sample, held)).prev_sample
        )
    return StepOutput(prev_sample, out.log_prob, out.mean, out.std)


class ChunkedCalls:
    """The calls part of `DiffusionPolicy` (a mixin: it reads the policy's `adapter`, `reduce`, `text_batch_size` and
    keeps `_text_cache`)."""

    text_store: TextStore | None = None
    """Prompt conditioning on disk (`store_text`)."""
    text_encoders_offloaded: bool = False
    """Whether the text encoders live in CPU memory (`offload_text_encoders`)."""

    # ------------------------------------------------------------------------------------------
    # conditioning
    # ------------------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str], *, negative: bool = False) -> dict[str, torch.Tensor]:
        """Conditioning `[len(prompts), ...]`, each distinct prompt encoded once and cached.

        Missing prompts are encoded in batches of exactly `text_batch_size` (the last one padded), so a prompt's
        embedding never depends on what it was batched with (resumed runs re-encode the same bits).
        `negative=True`: negative prompts (the unconditional branch); a family that encodes them differently
        (`adapter.negative_differs`) has them encoded by `adapter.encode_negative` and cached apart.
        """
        apart = negative and self.adapter.negative_differs
        encode = self.adapter.encode_negative if apart else self.adapter.encode
        keys = [("negative", p) if apart else p for p in prompts]
        missing = list(dict.fromkeys(p for p, key in zip(prompts, keys) if key not in self._text_cache))
        if self.text_store is not None:  # conditioning stored on disk by an earlier run or process
            stored = {p: self.text_store.get(("negative", p) if apart else p) for p in missing}
            for prompt, tensors in stored.items():
                if tensors is not None:
                    device = self.adapter.device
                    self._text_cache[("negative", prompt) if apart else prompt] = {
                        k: v.to(device) for k, v in tensors.items()
                    }
            missing = [p for p in missing if stored[p] is None]
        with (
            torch.no_grad(),
            encoders_on(self.adapter.pipeline, self.adapter.device, self.text_encoders_offloaded and bool(missing)),
        ):
            size = self.text_batch_size
            for start in range(0, len(missing), size):
                batch = missing[start : start + size]
                out = encode(batch + [batch[0]] * (size - len(batch)))
                for i, prompt in enumerate(batch):
                    key = ("negative", prompt) if apart else prompt
                    self._text_cache[key] = {k: v[i] for k, v in out.items()}
                    if self.text_store is not None:
                        self.text_store.put(key, self._text_cache[key])
        if len(keys) == 1:  # a view of the cache (the negative prompt's): the same storage every call, so rollouts
            # joined by `Record.cat` compare it without reading the device
            return {k: v.unsqueeze(0) for k, v in self._text_cache[keys[0]].items()}
        return {k: torch.stack([self._text_cache[key][k] for key in keys]) for k in self._text_cache[keys[0]]}

    def store_text(self, folder) -> None:
        """Keep prompt conditioning on disk in `folder` too (`flowrl.policies.text_store`; None: memory only). The
        folder must belong to this model and its options: `flowrl.policies.build` keys it by both."""
        self.text_store = None if folder is None else TextStore(folder)

    def offload_text_encoders(self) -> None:
        """Keep the text encoders in CPU memory; they move to the device only to encode a prompt in no cache."""
        offload_encoders(self.adapter.pipeline)
        self.text_encoders_offloaded = True

    @contextmanager
    def encoding_on(self, device):
        """Encode on `device` inside the block while the network is still elsewhere (in CPU memory): the text
        encoders move there for each encode and the conditioning stays there."""
        self.adapter.encode_device = torch.device(device)
        try:
            yield
        finally:
            self.adapter.encode_device = None

    def to_device(self, device) -> None:
        """Move the pipeline's networks to `device` (the text encoders too, unless they are offloaded) and the cached
        conditioning with them."""
        pipeline = self.adapter.pipeline
        skip = set(text_encoders(pipeline)) if self.text_encoders_offloaded else set()
        for name, component in pipeline.components.items():
            if isinstance(component, torch.nn.Module) and name not in skip:
                component.to(device)
        for key, tensors in self._text_cache.items():
            self._text_cache[key] = {k: v.to(device) for k, v in tensors.items()}

    def clear_text_cache(self) -> None:
        self._text_cache.clear()

    # ------------------------------------------------------------------------------------------
    # the network call and the step kernel, on fixed-size chunks
    # ------------------------------------------------------------------------------------------

    def _plan(self, n: int, size: int, cond: dict, null_cond: dict | None) -> list[_Chunk]:
        """Split `n` rows into chunks of exactly `size` rows (the last one padded with copies of its first row),
        with each chunk's conditioning gathered and, under CFG, the unconditional branch prepended once."""
        plan = []
        for start in range(0, n, size):
            rows = torch.arange(start, min(start + size, n))
            real = len(rows)
            if real < size:
                rows = torch.cat([rows, rows[:1].expand(size - real)])
            whole = real == n == size  # one full chunk: use the tensors as they are, no gathers
            chunk_cond = cond if whole else {k: v[to_device(rows, v.device)] for k, v in cond.items()}
            if null_cond is not None:
                chunk_cond = {
                    k: torch.cat([_unconditional(k, v, chunk_cond, null_cond, size), v])
                    for k, v in chunk_cond.items()
                    if not k.startswith(NEGATIVE)
                }
            elif any(k.startswith(NEGATIVE) for k in chunk_cond):
                chunk_cond = {k: v for k, v in chunk_cond.items() if not k.startswith(NEGATIVE)}
            plan.append(_Chunk(None if whole else rows, real, chunk_cond))
        return plan

    uncond_grad: bool = True
    """Whether the training gradient flows through CFG's unconditional branch (`sampling.uncond_grad`): both branches
    in one call of twice the rows, or (False) the unconditional branch in a call of its own without gradient
    (Flow-GRPO's SD3 script detaches it: half the training activations); rollouts split their calls the same way."""

    def _predict(
        self, model, latents, timesteps, chunk_cond, cfg: bool, guidance_scale: float, static: dict, host=None
    ):
        """One chunk-sized network call; under CFG both branches go through it as one batch (or, without the
        unconditional branch's gradient, two calls: that branch's under `no_grad`). `host`: the rows' timesteps on
        the host, for families that choose by timestep (`ModelAdapter.host_timesteps`)."""
        self.adapter.host_timesteps = host
        try:
            return self._predict_with(model, latents, timesteps, chunk_cond, cfg, guidance_scale, static, host)
        finally:
            self.adapter.host_timesteps = None

    def _predict_with(self, model, latents, timesteps, chunk_cond, cfg, guidance_scale, static, host):
        forward = self.adapter.forward
        if not cfg:
            return forward(latents, timesteps, chunk_cond, guidance_scale, model=model, static=static)
        if self.uncond_grad:
            self.adapter.host_timesteps = None if host is None else torch.cat([host, host])
            out = forward(
                torch.cat([latents, latents]),
                torch.cat([timesteps, timesteps]),
                chunk_cond,
                guidance_scale,
                model=model,
                static=static,
            )
            uncond, text = out.chunk(2)
            self.adapter.host_timesteps = host
        else:
            n = len(latents)  # each conditioning tensor holds the unconditional rows first (`_plan`)
            with torch.no_grad():
                uncond = forward(
                    latents,
                    timesteps,
                    {k: v[:n] for k, v in chunk_cond.items()},
                    guidance_scale,
                    model=model,
                    static=static,
                )
            text = forward(
                latents,
                timesteps,
                {k: v[n:] for k, v in chunk_cond.items()},
                guidance_scale,
                model=model,
                static=static,
            )
        return self.adapter.combine_cfg(uncond, text, self.adapter.step_guidance(guidance_scale, timesteps))

    def _kernel(self, kind, output, step, sigmas, timesteps, sample, *, prev_sample, noise, noise_level):
        """The step kernel for `sample [n, ...]` at step indices `step [n]`."""
        if self.adapter.time_kind == "ddim":
            eta = noise_level if kind == "ddim" else 0.0
            return ddim_step(
                self.adapter.scheduler,
                output,
                timesteps[step],
                sample,
                eta=eta,
                prev_sample=prev_sample,
                noise=noise,
                reduce=self.reduce,
                num_steps=len(timesteps),
            )
        fixed = self.adapter.ode_elements(sample)  # on ODE steps too: each step's `mean` is the free elements'
        if fixed is not None:  # some elements are not the policy's action (a start frame, LTX-2's audio)
            return _partly_ode(
                kind,
                fixed,
                output,
                sigmas[step],
                sigmas[step + 1],
                sample,
                prev_sample=prev_sample,
                noise=noise,
                noise_level=noise_level,
                reduce=self.reduce,
                sigma_max=sigmas[1],
            )
        return sde_step(
            kind,
            output,
            sigmas[step],
            sigmas[step + 1],
            sample,
            prev_sample=prev_sample,
            noise=noise,
            noise_level=noise_level,
            reduce=self.reduce,
            sigma_max=sigmas[1],
        )

    def _run(
        self,
        model,
        kind,
        states,
        step,
        plan,
        *,
        cfg,
        static,
        sigmas,
        timesteps,
        guidance_scale,
        noise_level,
        prev_sample=None,
        noise=None,
        predictions: list | None = None,
    ) -> StepOutput:
        """Network call + step kernel for every row of `states` (`step [n]` step indices), chunk by chunk.

        `predictions`, when a list, receives each chunk's (CFG-combined) network output for its real rows.
        """
        outs = []
        for chunk in plan:
            rows = slice(None) if chunk.rows is None else to_device(chunk.rows, states.device)
            chunk_step = step if chunk.rows is None else step[chunk.rows]
            x = states[rows]
            host = timesteps[chunk_step]
            t = host.to(x.device, non_blocking=True)  # the schedule is host data: no stream sync
            output = self._predict(model, x, t, chunk.cond, cfg, guidance_scale, static, host=host)
            if predictions is not None:
                predictions.append(output[: chunk.real])
            out = self._kernel(
                kind,
                output,
                chunk_step,
                sigmas,
                timesteps,
                x,
                noise_level=noise_level,
                prev_sample=None if prev_sample is None else prev_sample[rows],
                noise=None if noise is None else noise[rows],
            )
            outs.append(out if chunk.rows is None else StepOutput(*(t[: chunk.real] for t in out)))
        if len(outs) == 1:
            return outs[0]
        return StepOutput(*(torch.cat(parts) for parts in zip(*outs)))
