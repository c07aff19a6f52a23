"""How each diffusers architecture is conditioned, called, scheduled and decoded.

An adapter wraps a diffusers pipeline object used only as a container of components and of its helper
methods (`encode_prompt`, `prepare_latents`, latent packing, the image post-processor), so prompt encoding,
initial noise, timestep schedules and decoding are bit-for-bit the pipeline's own. The denoising loop is
flowrl's (`DiffusionPolicy`), which needs per-step log-probabilities that pipelines do not expose.

Latents stay in the layout the network consumes, as in the pipelines: `[B, C, h, w]` for SD3 and UNets,
2x2-packed tokens `[B, h*w/4, 4C]` for Flux. Step kernels and log-probs are element-wise, so the layout does
not change any number; `decode` unpacks.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from flowrl.registry import Registry


MODEL_FAMILIES: Registry = Registry("model family")
"""Family name -> adapter class; `register_family` adds one (a new architecture is one adapter class)."""


def register_family(cls):
    """Class decorator: register a `ModelAdapter` subclass under its `family` (and its pipeline class)."""
    MODEL_FAMILIES.register(cls.family, cls, description=(cls.__doc__ or "").strip().splitlines()[0])
    return cls


class ModelAdapter(ABC):
    """Base class. `encode` returns per-prompt conditioning; `forward` is one network call without CFG.

    A family declares its name, the diffusers pipeline class it wraps (what `model_index.json` names), its
    default LoRA targets and the prefix diffusers' LoRA loaders use for the trained network.
    """

    family: str = ""
    pipeline_class: str = ""
    """The diffusers pipeline class name (`StableDiffusion3Pipeline`)."""
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    """Default LoRA target modules."""
    lora_prefix: str = "transformer"
    """The network's name in diffusers' LoRA files (`transformer`, `unet`)."""
    time_kind: str = "flow"  # "flow": sigma schedules and sde_step; "ddim": alphas and ddim_step
    default_sampler: str = "flow_sde"

    def __init__(self, pipeline, *, max_sequence_length: int | None = None):
        self.pipeline = pipeline
        self.max_sequence_length = max_sequence_length
        self.scheduler = copy.deepcopy(pipeline.scheduler)  # private copy: set_timesteps mutates state

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The trainable network (transformer or UNet)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether `guidance_scale` is applied as classifier-free guidance (two branches per forward)."""
        return guidance_scale > 1.0

    @abstractmethod
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Conditioning tensors, each batched over `prompts` (`[P, ...]`)."""

    def static_inputs(self, height: int, width: int) -> dict:
        """Inputs that depend only on the image size, computed once per rollout (Flux's image ids)."""
        return {}

    @abstractmethod
    def forward(self, latents, timesteps, cond, guidance_scale: float, model=None, static=None) -> torch.Tensor:
        """The prediction of `model` (default: `self.model`) for `latents [N, ...]` at `timesteps [N]`.

        No CFG combination here: the policy batches both branches into one call.
        """

    @abstractmethod
    def initial_latents(self, batch_size: int, height: int, width: int, generator) -> torch.Tensor:
        """Initial noise `[B, C, h, w]` drawn exactly as the pipeline draws it."""

    @abstractmethod
    def schedule(self, num_steps: int, latent_shape) -> tuple[torch.Tensor, torch.Tensor]:
        """`(timesteps [T] as the network sees them, sigmas [T + 1] in the flow convention)`."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Images `[B, 3, H, W]` in [0, 1]."""

    def shift_mu(self, latent_shape) -> float | None:
        """The resolution-dependent shift `mu` the schedule uses (None: the scheduler's static `shift`)."""
        return None

    def resample_sigmas(self, sigma_start: float, num_intervals: int, latent_shape) -> torch.Tensor:
        """`[num_intervals + 1]` sigmas from `sigma_start` down to 0, uniform in the scheduler's unshifted time.

        MixGRPO-Flash's re-discretisation after the SDE window (`dpm_apply_strategy="post"`): a flow scheduler
        maps unshifted `t` to `s = a t / (1 + (a - 1) t)` (`a` = its `shift`, or `e^mu` / `mu` for exponential /
        linear dynamic shifting), so `sigma_start` is unshifted, `num_intervals` equal steps are taken to 0,
        and the points are shifted back; the first point is `sigma_start` itself.
        """
        if self.time_kind != "flow":
            raise ValueError(f"re-discretising the sigmas needs a flow-matching model, not a {self.family} model")
        if num_intervals < 1:
            raise ValueError(f"num_intervals must be >= 1, got {num_intervals}")
        config = self.scheduler.config
        mu = self.shift_mu(latent_shape)
        if mu is None:
            a = float(config.get("shift", 1.0))
        else:
            a = math.exp(mu) if config.get("time_shift_type", "exponential") == "exponential" else float(mu)
        t0 = sigma_start / (a - (a - 1) * sigma_start)  # the inverse of the shift
        t = torch.linspace(t0, 0.0, num_intervals + 1, dtype=torch.float64)
        sigmas = (a * t / (1 + (a - 1) * t)).float()
        sigmas[0] = sigma_start
        return sigmas

    def default_size(self) -> tuple[int, int]:
        """The pipeline's default image size."""
        pipe = self.pipeline
        sample = getattr(pipe, "default_sample_size", None) or self.model.config.sample_size
        size = sample * pipe.vae_scale_factor
        return size, size


def _text_kwargs(max_sequence_length):
    return {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}


def _decode_vae(pipeline, latents, shift: bool = True) -> torch.Tensor:
    vae = pipeline.vae
    latents = latents.to(vae.dtype) / vae.config.scaling_factor
    if shift and vae.config.get("shift_factor") is not None:
        latents = latents + vae.config.shift_factor
    image = vae.decode(latents, return_dict=False)[0]
    return pipeline.image_processor.postprocess(image, output_type="pt")


@register_family
class SD3Adapter(ModelAdapter):
    """Stable Diffusion 3 / 3.5: `SD3Transformer2DModel`, CLIP-L + CLIP-G + T5, flow matching."""

    family = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    """Flow-GRPO's SD3 set: the attention projections of both streams."""

    @property
    def model(self):
        return self.pipeline.transformer

    def encode(self, prompts):
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            **_text_kwargs(self.max_sequence_length),
        )  # fmt: skip
        return {"prompt_embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        return (model or self.model)(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled"],
            return_dict=False,
        )[0]

    def initial_latents(self, batch_size, height, width, generator):
        channels = self.model.config.in_channels
        return self.pipeline.prepare_latents(
            batch_size, channels, height, width, self.dtype, self.device, generator, None
        )

    def schedule(self, num_steps, latent_shape):
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

        mu = self.shift_mu(latent_shape)
        kwargs = {} if mu is None else {"mu": mu}
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, self.device, **kwargs)
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def shift_mu(self, latent_shape):
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        config = self.scheduler.config
        if not config.get("use_dynamic_shifting", None):
            return None
        patch = self.model.config.patch_size
        seq_len = (latent_shape[-2] // patch) * (latent_shape[-1] // patch)
        return calculate_shift(
            seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.16),
        )

    def decode(self, latents, height, width):
        return _decode_vae(self.pipeline, latents)


@register_family
class FluxAdapter(ModelAdapter):
    """Flux.1: `FluxTransformer2DModel` on 2x2-packed latents with image ids; guidance is an embedding.

    Flux.1-dev is guidance-distilled: `guidance_scale` is fed to the guidance embedding (no second CFG
    branch), exactly as `FluxPipeline` does.
    """

    family = "flux"
    pipeline_class = "FluxPipeline"
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

    @property
    def model(self):
        return self.pipeline.transformer

    def uses_cfg(self, guidance_scale):
        return False

    def encode(self, prompts):
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, **_text_kwargs(self.max_sequence_length)
        )
        return {"prompt_embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def static_inputs(self, height, width):
        vsf = self.pipeline.vae_scale_factor
        h, w = 2 * (int(height) // (vsf * 2)), 2 * (int(width) // (vsf * 2))
        return {"img_ids": self.pipeline._prepare_latent_image_ids(1, h // 2, w // 2, self.device, self.dtype)}

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        model = model or self.model
        n = latents.shape[0]
        guidance = None
        if self.model.config.guidance_embeds:  # (read from the bare model: a DDP wrapper has no config)
            guidance = torch.full([1], guidance_scale, device=latents.device, dtype=torch.float32).expand(n)
        return model(
            hidden_states=latents,
            timestep=timesteps.to(latents.dtype) / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=torch.zeros(cond["prompt_embeds"].shape[1], 3, device=latents.device, dtype=latents.dtype),
            img_ids=static["img_ids"],
            return_dict=False,
        )[0]

    def initial_latents(self, batch_size, height, width, generator):
        channels = self.model.config.in_channels // 4
        packed, _ = self.pipeline.prepare_latents(
            batch_size, channels, height, width, self.dtype, self.device, generator, None
        )
        return packed

    def schedule(self, num_steps, latent_shape):
        from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if self.scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        mu = self.shift_mu(latent_shape)
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def shift_mu(self, latent_shape):
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        if not config.get("use_dynamic_shifting", None):
            return None
        return calculate_shift(
            latent_shape[1],  # packed tokens, as the pipeline's image_seq_len
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )

    def decode(self, latents, height, width):
        spatial = self.pipeline._unpack_latents(latents, height, width, self.pipeline.vae_scale_factor)
        return _decode_vae(self.pipeline, spatial)


@register_family
class UNetAdapter(ModelAdapter):
    """SD1.x / SD2.x: `UNet2DConditionModel` with a DDIM scheduler (DDPO's sampler)."""

    family = "unet"
    pipeline_class = "StableDiffusionPipeline"
    lora_prefix = "unet"
    time_kind = "ddim"
    default_sampler = "ddim"

    def __init__(self, pipeline, *, max_sequence_length=None):
        super().__init__(pipeline, max_sequence_length=max_sequence_length)
        from diffusers import DDIMScheduler

        if not isinstance(self.scheduler, DDIMScheduler):
            self.scheduler = DDIMScheduler.from_config(self.scheduler.config)

    @property
    def model(self):
        return self.pipeline.unet

    def encode(self, prompts):
        embeds, _ = self.pipeline.encode_prompt(prompts, self.device, 1, False)
        return {"prompt_embeds": embeds.to(self.dtype)}

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        latents = self.scheduler.scale_model_input(latents, timesteps)
        return (model or self.model)(
            latents, timesteps, encoder_hidden_states=cond["prompt_embeds"], return_dict=False
        )[0]

    def initial_latents(self, batch_size, height, width, generator):
        channels = self.model.config.in_channels
        return self.pipeline.prepare_latents(
            batch_size, channels, height, width, self.dtype, self.device, generator, None
        )

    def schedule(self, num_steps, latent_shape):
        self.scheduler.set_timesteps(num_steps, device=self.device)
        timesteps = self.scheduler.timesteps
        alphas = self.scheduler.alphas_cumprod.to(torch.float32)
        last = int(timesteps[-1]) - self.scheduler.config.num_train_timesteps // num_steps
        final = alphas[last] if last >= 0 else torch.as_tensor(self.scheduler.final_alpha_cumprod, dtype=torch.float32)
        alpha_bar = torch.cat([alphas[timesteps.cpu()], final.reshape(1)])  # [T + 1]
        # the flow-matching noise level with the same signal-to-noise ratio: x_t / (sqrt(a) + sqrt(1 - a))
        sigmas = (1 - alpha_bar).sqrt() / (alpha_bar.sqrt() + (1 - alpha_bar).sqrt())
        return timesteps, sigmas

    def decode(self, latents, height, width):
        return _decode_vae(self.pipeline, latents, shift=False)


class CallableAdapter(ModelAdapter):
    """Any velocity network plus a text encoder and a decoder given as callables (e.g. the digits world).

    Args:
        model (`torch.nn.Module`): `model(hidden_states, timestep, encoder_hidden_states, pooled_projections)`
            in the `SD3Transformer2DModel` calling convention, predicting the velocity.
        encode (`Callable`): `prompts -> {"prompt_embeds": [P, L, D], "pooled": [P, D']}`.
        decode (`Callable`): `latents -> images [B, 3, H, W] in [0, 1]`.
        latent_shape (`tuple`): `(C, h, w)` of one latent.
        scheduler: a `FlowMatchEulerDiscreteScheduler` (its `set_timesteps` gives the sigmas).
    """

    family = "callable"

    def __init__(self, model, encode: Callable, decode: Callable, latent_shape, scheduler):
        self._model, self._encode, self._decode = model, encode, decode
        self.latent_shape = tuple(latent_shape)
        self.scheduler = copy.deepcopy(scheduler)
        self.pipeline = None
        self.max_sequence_length = None

    @property
    def model(self):
        return self._model

    @property
    def dtype(self):
        return next(self._model.parameters()).dtype

    @property
    def device(self):
        return next(self._model.parameters()).device

    def encode(self, prompts):
        return {k: v.to(device=self.device, dtype=self.dtype) for k, v in self._encode(prompts).items()}

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        out = (model or self._model)(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled"],
        )
        return out[0] if isinstance(out, tuple) else getattr(out, "sample", out)

    def initial_latents(self, batch_size, height, width, generator):
        from diffusers.utils.torch_utils import randn_tensor

        shape = (batch_size, *self.latent_shape)
        return randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)

    def schedule(self, num_steps, latent_shape):
        self.scheduler.set_timesteps(num_steps, device=self.device)
        return self.scheduler.timesteps, self.scheduler.sigmas.to(torch.float32)

    def decode(self, latents, height, width):
        return self._decode(latents)

    def default_size(self):
        return self.latent_shape[-2], self.latent_shape[-1]


def adapter_for(pipeline, **kwargs) -> ModelAdapter:
    """The adapter for a diffusers pipeline instance (SD3/3.5, Flux.1, SD1.x/2.x: `MODEL_FAMILIES`)."""
    name = type(pipeline).__name__
    for family in MODEL_FAMILIES:
        cls = MODEL_FAMILIES.get(family)
        if cls.pipeline_class == name:
            return cls(pipeline, **kwargs)
    supported = ", ".join(MODEL_FAMILIES.get(f).pipeline_class for f in MODEL_FAMILIES)
    raise ValueError(f"no flowrl adapter for {name}; supported pipelines: {supported}")
