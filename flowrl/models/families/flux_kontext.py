"""FLUX.1 Kontext: the Flux.1 adapter with source images (editing), its options and a tiny offline
`FluxKontextPipeline`."""

from __future__ import annotations

import dataclasses

import torch

from flowrl.models.families import register_family
from flowrl.models.families.flux import FluxAdapter
from flowrl.models.helpers import flux_forward, guidance_embedding


@dataclasses.dataclass
class FluxKontextOptions:
    """Options of FLUX.1 Kontext (`model.options`)."""

    max_sequence_length: int | None = None
    """Text tokens for T5 (None: the pipeline's 512)."""
    condition_size: list[int] | None = None
    """`[height, width]` every source image is resized to before the VAE (Flow-Factory's `condition_image_size`: 384
    in training, 512 in evaluation), floored to a multiple of 16 pixels. None: the pipeline's rule (`auto_resize`)."""
    auto_resize: bool = True
    """With `condition_size` None: resize a source image to the preferred Kontext resolution of its aspect ratio
    (the pipeline's `_auto_resize=True`, about 1 megapixel), or (False) keep its size floored to a multiple of 16."""

    def __post_init__(self):
        size = self.condition_size
        if size is not None and (len(size) != 2 or min(size) < 1):
            raise ValueError(f"model.options.condition_size must be [height, width], got {size}")


@register_family
class FluxKontextAdapter(FluxAdapter):
    """FLUX.1 Kontext: Flux.1 whose source-image latents join the target tokens on the sequence axis.

    As `FluxKontextPipeline` does: a source image is resized, normalised and VAE-encoded (the latent mode, so it
    needs no noise), packed 2x2 into tokens with image ids whose first coordinate is 1 (the target's are 0), and
    concatenated after the target tokens; the prediction is sliced back to the target tokens. Without source images
    it is Flux.1 text-to-image. Guidance is the distilled embedding (`guidance_scale`, no second CFG branch). The image
    size is flowrl's `height`/`width` exactly (the pipeline rescales them to `max_area`, so it matches with
    `max_area=height * width`: `pipeline_size_kwargs`).
    """

    family = "flux_kontext"
    Options = FluxKontextOptions
    pipeline_class = "FluxKontextPipeline"
    real_models = ("black-forest-labs/FLUX.1-Kontext-dev: 12B",)
    # Flow-Factory's default targets (`src/flow_factory/models/flux/flux1_kontext.py:140`, `default_target_modules`)
    lora_targets = (
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
        "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff_context.net.0.proj", "ff.net.2", "ff_context.net.2",
    )  # fmt: skip
    conditioning = "edit"

    @classmethod
    def pipeline_size_kwargs(cls, height: int, width: int) -> dict:
        """`FluxKontextPipeline.__call__` arguments that sample `height` x `width` as flowrl does: the pipeline
        rescales the requested size to `max_area` (default 1024^2), flowrl keeps it."""
        return {"max_area": height * width}

    def pipeline_source_kwargs(self) -> dict:
        """`_auto_resize` as `model.options.auto_resize`: a source image resized to the preferred Kontext resolution
        of its aspect ratio, or kept at its size (as with `condition_size`, to which flowrl resized it first)."""
        return {"_auto_resize": self.options.auto_resize and self.options.condition_size is None}

    def prepare_sources(self, images):
        """The pipeline's step 3 (`FluxKontextPipeline.__call__`: resize, then `image_processor.preprocess` to [-1, 1])
        on each image: `(pixels [N, 3, H', W'] in [0, 1], N normalised [1, 3, H', W'] tensors)`."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        if len(images) != 1:  # as the pipeline (and Flow-Factory, which keeps the first) takes them
            raise ValueError(f"FLUX.1 Kontext edits one source image per prompt, got {len(images)}")
        processor, multiple = self.pipeline.image_processor, self.pipeline.vae_scale_factor * 2
        out = []
        for image in images:
            if isinstance(image, torch.Tensor):
                image = image.unsqueeze(0) if image.ndim == 3 else image  # the processor takes [1, 3, H, W]
            if self.options.condition_size is not None:
                height, width = self.options.condition_size
            else:
                height, width = processor.get_default_height_width(image)
                if self.options.auto_resize:  # Kontext is trained on these resolutions
                    ratio = width / height
                    _, width, height = min((abs(ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
            height, width = height // multiple * multiple, width // multiple * multiple
            image = processor.resize(image, height, width)
            out.append(processor.preprocess(image, height, width))
        # the processor's tensors are kept as they are (a copy with other strides encodes to other last bits)
        return (torch.cat(out) / 2 + 0.5).clamp(0, 1), out

    def encode_sources(self, prompt, inputs):
        """`FluxKontextPipeline.prepare_latents` on one sample's N `inputs` `[1, 3, H', W']`: the latent mode of each
        image (shifted, scaled), packed, the N images' tokens one after another: `image_latents [N L_c, 4C]` and
        `image_ids [N L_c, 3]` (first coordinate 1). The prompt does not enter."""
        pipe = self.pipeline
        latents, ids = [], []
        for image in inputs:
            image = image.to(device=self.device, dtype=pipe.vae.dtype)
            latent = pipe._encode_vae_image(image=image, generator=None)  # the mode: no noise drawn
            channels, h, w = latent.shape[1:]
            latents.append(pipe._pack_latents(latent, 1, channels, h, w)[0])
            image_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, self.dtype)
            image_ids[..., 0] = 1
            ids.append(image_ids)
        return {"image_latents": torch.cat(latents).to(self.dtype), "image_ids": torch.cat(ids)}

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        if "image_latents" not in cond:  # text-to-image: Flux.1
            return super().forward(latents, timesteps, cond, guidance_scale, model=model, static=static)
        return flux_forward(
            model or self.model,
            latents,
            timesteps,
            guidance_embedding(self.model, guidance_scale, latents.shape[0], latents.device),
            image_latents=cond["image_latents"],
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=torch.zeros(cond["prompt_embeds"].shape[1], 3, device=latents.device, dtype=latents.dtype),
            img_ids=torch.cat([static["img_ids"], cond["image_ids"][0].to(static["img_ids"])]),  # one size per rollout
        )

    def initial_latents(self, batch_size, height, width, generator):
        return self.pipeline_latents(batch_size, height, width, generator, image=True)

    @staticmethod
    def tiny(seed: int = 0, latent_channels: int = 16):
        """A `FluxKontextPipeline` from the tiny Flux.1 components (`FluxAdapter.tiny`: a 1+1-block transformer with
        the guidance embedding, tiny CLIP + T5, a 2-level VAE)."""
        from diffusers import FluxKontextPipeline

        flux = FluxAdapter.tiny(seed=seed, latent_channels=latent_channels)
        return FluxKontextPipeline(**flux.components)
