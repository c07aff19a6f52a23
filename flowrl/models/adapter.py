"""How each diffusers architecture is conditioned, called, scheduled and decoded: `ModelAdapter`, the base class of
every model family (`flowrl.models.families`, where the family registry is), and `CallableAdapter`.

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
import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


@dataclasses.dataclass
class NoOptions:
    """A family without options of its own."""


@dataclasses.dataclass
class TextEncoderOptions:
    """Options of a family with a T5 text encoder."""

    max_sequence_length: int | None = None
    """Text tokens for T5 (None: the pipeline's default: SD3 256, Flux 512)."""


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
    lora_loader: str | None = None
    """How diffusers loads the family's LoRA file: None, the pipeline's `load_lora_weights(dir)` (its LoRA loader
    mixin); else the pipeline component that loads it with `load_lora_adapter(dir, prefix=lora_prefix)`, for a
    pipeline without a LoRA loader (HunyuanVideo 1.5: `"transformer"`). `load_lora_into` and `lora_load_line` follow
    it; `policy.save_lora` writes the same file either way."""
    time_kind: str = "flow"  # "flow": sigma schedules and sde_step; "ddim": alphas and ddim_step
    default_sampler: str = "flow_sde"
    Options: type = NoOptions
    """The family's options (`model.options`): a dataclass with a docstring per field."""
    attention_mask: str | None = None
    """The attention mask its network hands to diffusers' dispatch, one of `flowrl.models.attention.MASK_LAYOUTS`
    (None: no mask, or attention not dispatched): `model.attention_backend: auto` tries only the kernels that honour
    it."""
    video: bool = False
    """Whether the family makes videos (latents `[B, C, F', h, w]`, `decode` gives `[B, 3, F, H, W]`)."""
    pipeline_output: str = "images"
    """The field of the image pipeline's output holding its images (Kandinsky 5's: `image`; video pipelines':
    `frames`)."""
    real_models: tuple[str, ...] = ()
    """The published checkpoints of the family with their trained network's parameter count, as their model cards
    give them (`flowrl list models`): e.g. `"stabilityai/stable-diffusion-3.5-medium: 2.5B"`."""

    def __init__(self, pipeline, *, options=None):
        self.pipeline = pipeline
        self.options = self.make_options(options)
        self.scheduler = copy.deepcopy(pipeline.scheduler)  # private copy: set_timesteps mutates state

    @classmethod
    def make_options(cls, options=None):
        """`options` (a dict of `Options` fields, an `Options`, or None) as an `Options`, validated: an unknown key
        fails naming the family's options."""
        if isinstance(options, cls.Options):
            return options
        if options and not dataclasses.fields(cls.Options):
            raise ValueError(f"model family {cls.family!r} has no options; remove model.options {sorted(options)}")
        from flowrl.config import from_dict

        return from_dict(cls.Options, dict(options or {}), prefix="model.options")

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The trainable network (transformer or UNet)."""

    encode_device: torch.device | None = None
    """Where `encode` runs while the network is elsewhere (prompts encoded on the GPU before the network moves there:
    `DiffusionPolicy.encoding_on`); None: the network's device."""

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.encode_device if self.encode_device is not None else self.model.device

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether `guidance_scale` is applied as classifier-free guidance (two branches per forward)."""
        return guidance_scale > 1.0

    def combine_cfg(self, uncond: torch.Tensor, text: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """The guided prediction from the two branches (`uncond + s (text - uncond)`; a family that renormalises,
        as Qwen-Image does, overrides this). A per-row scale (`step_guidance`) comes as host data and moves here."""
        if isinstance(guidance_scale, torch.Tensor):
            guidance_scale = guidance_scale.to(text.device, non_blocking=True)
        return uncond + guidance_scale * (text - uncond)

    host_timesteps: torch.Tensor | None = None
    """The current call's `[N]` timesteps on the host (the policy sets it around each call), for a family that chooses
    by timestep (Wan 2.2's experts, Z-Image's CFG truncation) without reading the device."""

    def timesteps_on_host(self, timesteps: torch.Tensor) -> torch.Tensor:
        """`timesteps [N]` as host data: the call's host copy when the policy gave one, else read back (a sync)."""
        host = self.host_timesteps
        return host if host is not None and len(host) == len(timesteps) else timesteps.cpu()

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, batch_size: int, negative_prompt: str = "") -> dict:
        """The diffusers pipeline's `__call__` arguments that guide as flowrl's `guidance_scale` and
        `negative_prompt` do, for `batch_size` prompts (default `{"guidance_scale": s}`; Qwen-Image's true CFG
        takes `true_cfg_scale` and a negative prompt per image)."""
        return {"guidance_scale": guidance_scale}

    @classmethod
    def pipeline_size_kwargs(cls, height: int, width: int) -> dict:
        """The diffusers pipeline's `__call__` arguments (besides `height`, `width`) that make it sample `height` x
        `width` as flowrl does (default none; FLUX.1 Kontext rescales to `max_area` unless told the same area)."""
        return {}

    def pipeline_source_kwargs(self) -> dict:
        """The diffusers pipeline's `__call__` arguments that prepare a source image as this adapter does with its
        `model.options` (default none; FLUX.1 Kontext: `_auto_resize`)."""
        return {}

    @classmethod
    def pipeline_load_kwargs(cls, name_or_path: str) -> dict:
        """Components `load_pipeline` passes to the pipeline's `from_pretrained` instead of loading them itself
        (default none; Qwen-Image-Edit: its processor, without the video processor that needs torchvision)."""
        return {}

    @classmethod
    def set_pipeline_guidance(cls, pipeline, guidance_scale: float) -> None:
        """Make a diffusers `pipeline` guide as flowrl's `guidance_scale` where a component, not a `__call__`
        argument, holds the scale (default nothing; HunyuanVideo 1.5: its `guider`)."""
        return None

    @classmethod
    def set_pipeline_size(cls, pipeline, height: int, width: int) -> None:
        """Make a diffusers `pipeline` sample `height` x `width` where it would change that size itself (default
        nothing; Kandinsky 5's image pipeline snaps a size outside its `resolutions` to one of them)."""
        return None

    @classmethod
    def load_lora_into(cls, pipeline, directory) -> None:
        """Load a LoRA that `policy.save_lora` wrote into a diffusers `pipeline` of the family (`lora_loader`)."""
        if cls.lora_loader is None:
            pipeline.load_lora_weights(str(directory))
            return
        getattr(pipeline, cls.lora_loader).load_lora_adapter(
            str(directory), prefix=cls.lora_prefix, weight_name="pytorch_lora_weights.safetensors"
        )

    @classmethod
    def lora_load_line(cls, directory, extra: str = "") -> str:
        """`load_lora_into` as the diffusers line a user runs on `pipe` (`extra`: more `load_lora_weights` arguments
        as source text, e.g. `", load_into_transformer_2=True"`)."""
        if cls.lora_loader is None:
            return f"pipe.load_lora_weights({str(directory)!r}{extra})"
        return (
            f"pipe.{cls.lora_loader}.load_lora_adapter({str(directory)!r}, prefix={cls.lora_prefix!r}, "
            "weight_name='pytorch_lora_weights.safetensors')"
        )

    def step_guidance(self, guidance_scale: float, timesteps: torch.Tensor):
        """The CFG scale at each row's timestep (`timesteps [N]`): `guidance_scale` (a family whose scale changes
        along the trajectory, as Wan 2.2's low-noise expert does, returns another float or a `[N, 1, ...]` host
        tensor, from `timesteps_on_host`)."""
        return guidance_scale

    @abstractmethod
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Conditioning tensors, each batched over `prompts` (`[P, ...]`).

        A prompt's tensors must not depend on the prompts batched with it (the policy caches them per prompt and
        stacks them): a family whose text encoder pads to the longest prompt pads to a fixed length instead and
        returns the attention mask with the embeddings.
        """

    negative_differs: bool = False
    """Whether negative prompts (the unconditional branch) are encoded by `encode_negative`, not `encode`; the policy
    then caches them apart from prompts (SANA: its pipeline encodes the negative prompt without the instruction it
    prepends to prompts)."""

    def encode_negative(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Conditioning of negative prompts, as `encode` (used when `negative_differs`)."""
        return self.encode(prompts)

    def static_inputs(self, height: int, width: int) -> dict:
        """Inputs that depend only on the image size, computed once per rollout (Flux's image ids)."""
        return {}

    @abstractmethod
    def forward(self, latents, timesteps, cond, guidance_scale: float, model=None, static=None) -> torch.Tensor:
        """The prediction of `model` (default: `self.model`) for `latents [N, ...]` at `timesteps [N]`.

        No CFG combination here: the policy batches both branches into one call.
        """

    packed_latents: bool = False
    """Whether latents are 2x2-packed tokens `[B, h*w/4, 4C]` (FLUX.1, Qwen-Image, FLUX.2: 4 `in_channels` each)."""

    def initial_latents(self, batch_size: int, height: int, width: int, generator) -> torch.Tensor:
        """Initial noise `[B, C, h, w]` (or packed tokens) drawn exactly as the pipeline draws it."""
        return self.pipeline_latents(batch_size, height, width, generator)

    def pipeline_latents(self, batch_size, height, width, generator, *, dtype=None, image: bool = False):
        """The noise of the pipeline's `prepare_latents(batch_size, channels, height, width, dtype, device, generator,
        None)` (`channels`: `in_channels`, / 4 if packed; `dtype`: the model's), after a `None` source with `image`."""
        channels = self.model.config.in_channels // (4 if self.packed_latents else 1)
        dtype = self.dtype if dtype is None else dtype
        args = (batch_size, channels, height, width, dtype, self.device, generator, None)
        out = self.pipeline.prepare_latents(*((None, *args) if image else args))
        return out[0] if isinstance(out, tuple) else out

    @abstractmethod
    def schedule(self, num_steps: int, latent_shape) -> tuple[torch.Tensor, torch.Tensor]:
        """`(timesteps [T] as the network sees them, sigmas [T + 1] in the flow convention)`, on the CPU: the
        schedule is host data (the policy moves what each call needs without a device sync and reads it freely)."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Images `[B, 3, H, W]` in [0, 1]."""

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Latents `[B, ...]` of images `[B, 3, H, W]` in [0, 1] at the model's size: what offline preference data
        trains on (`flowrl.image.preferences`). Families without an image encoder here raise."""
        raise ValueError(
            f"model family {self.family!r} cannot encode images into its latents here yet (offline "
            "preference data needs it; the digits world can)"
        )

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
        if mu is None:  # FlowMatchEuler's `shift`; UniPC / DPM-Solver flow schedulers call it `flow_shift`
            a = float(config.get("shift", None) or config.get("flow_shift", None) or 1.0)
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

    # conditioning images (`flowrl.policies.sources`): editing sources and image-to-video start frames

    conditioning: str | None = None
    """What the family's conditioning images are: None (text only), `"edit"` (the source images an edit starts from:
    FLUX.1 Kontext, Qwen-Image-Edit) or `"start_frame"` (image-to-video: the image the video starts from). Either
    way a sample is a (prompt, images) pair, prepared by `prepare_sources` and encoded by `encode_sources`."""
    conditions_at_size: bool = False
    """Whether the conditioning images are prepared at the sample's size (image-to-video: the start frame is the
    video's first frame): `prepare_sources` then takes `size=(height, width)` and a pair's key includes the size."""
    negative_sees_sources: bool = False
    """Whether the negative prompt is encoded with each pair's source images too (`encode_source_text`;
    Qwen-Image-Edit: its vision-language encoder sees them), so the unconditional branch is per pair
    (`flowrl.policies.sources`)."""
    pipeline_needs_sources: bool = False
    """Whether the diffusers pipeline refuses a call without a source image (its tests then pass one)."""

    @property
    def edits(self) -> bool:
        """Whether the family conditions on images (an editing or image-to-video model)."""
        return self.conditioning is not None

    def prepare_sources(self, images: list, size: tuple[int, int] | None = None) -> tuple[torch.Tensor, object]:
        """One sample's conditioning images (PIL images or `[3, H, W]` tensors in [0, 1]) as the pipeline prepares
        them: `(pixels [N, 3, H', W'] in [0, 1], inputs)`: the resized images (what rewards compare with) and what
        `encode_sources` takes (FLUX.1 Kontext: the pipeline's normalised `[1, 3, H', W']` tensors, one per image).
        `size`: the sample's `(height, width)`, given to families with `conditions_at_size`."""
        raise ValueError(
            f"model family {self.family!r} takes no conditioning images (it is not an editing or image-to-video model)"
        )

    def place_conditions(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The initial state from the initial noise `latents [B, ...]` and each row's conditioning `cond` (default:
        the noise; an image-to-video family whose pipeline keeps the start frame's clean latent in the state, as
        LTX-2's and Wan 2.2 TI2V's do, writes it there)."""
        return latents

    def ode_elements(self, latents: torch.Tensor) -> torch.Tensor | None:
        """`[...]` bool over one sample's latent elements (`latents [B, ...]`'s trailing shape), on the CPU (it comes
        from the shape: host data), that every step moves by the deterministic ODE, also on stochastic steps: no
        noise, no log-probability (they are not the policy's action). None (default, and for any other shape):
        every element follows the step's kernel. Image-to-video families mark the start frame's latent (its velocity
        is 0: it stays the clean image latent); LTX-2 its audio latents."""
        return None

    def encode_sources(self, prompt: str, inputs) -> dict[str, torch.Tensor]:
        """The conditioning of one (prompt, source images) pair from `prepare_sources`'s `inputs`, unbatched
        (FLUX.1 Kontext: packed VAE latents `[L_c, 4C]` and their image ids `[L_c, 3]`). The policy adds these to the
        prompt's text conditioning row by row (a key named like a text key replaces it: a family whose text encoder
        sees the image, as Qwen-Image-Edit's does, returns its prompt embeddings here); `forward` reads them."""
        raise ValueError(
            f"model family {self.family!r} takes no conditioning images (it is not an editing or image-to-video model)"
        )

    def encode_source_text(self, prompt: str, inputs) -> dict[str, torch.Tensor]:
        """The text conditioning of `prompt` shown with one pair's prepared sources (families with
        `negative_sees_sources`: the negative prompt's conditioning per pair)."""
        raise ValueError(f"model family {self.family!r} does not encode text with source images")


class CallableAdapter(ModelAdapter):
    """Any velocity network plus a text encoder and a decoder given as callables (e.g. the digits world).

    Args:
        model (`torch.nn.Module`): `model(hidden_states, timestep, encoder_hidden_states, pooled_projections)`
            in the `SD3Transformer2DModel` calling convention, predicting the velocity.
        encode (`Callable`): `prompts -> {"prompt_embeds": [P, L, D], "pooled": [P, D']}`.
        decode (`Callable`): `latents -> images [B, 3, H, W] in [0, 1]`.
        latent_shape (`tuple`): `(C, h, w)` of one latent.
        scheduler: a `FlowMatchEulerDiscreteScheduler` (its `set_timesteps` gives the sigmas).
        encode_images (`Callable`, *optional*): `images [B, 3, H, W] in [0, 1] -> latents` (the inverse of
            `decode`; offline preference data needs it).
    """

    family = "callable"

    def __init__(
        self, model, encode: Callable, decode: Callable, latent_shape, scheduler, encode_images: Callable | None = None
    ):
        self._model, self._encode, self._decode = model, encode, decode
        self._encode_images = encode_images
        self.latent_shape = tuple(latent_shape)
        self.scheduler = copy.deepcopy(scheduler)
        self.pipeline = None
        self.options = NoOptions()

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
        self.scheduler.set_timesteps(num_steps, device="cpu")
        return self.scheduler.timesteps, self.scheduler.sigmas.to(torch.float32)

    def decode(self, latents, height, width):
        return self._decode(latents)

    def encode_images(self, images):
        if self._encode_images is None:
            return super().encode_images(images)
        return self._encode_images(images).to(device=self.device, dtype=self.dtype)

    def default_size(self):
        return self.latent_shape[-2], self.latent_shape[-1]
