"""Stable Diffusion XL with DDIM (DDPO's sampler): the adapter, its options and a tiny offline
`StableDiffusionXLPipeline`."""

from __future__ import annotations

import dataclasses

import torch

from flowrl.models.families import register_family
from flowrl.models.families.unet import UNetAdapter
from flowrl.models.tiny import _clip_text_encoder, _eval, _vae, tiny_clip_tokenizer


@dataclasses.dataclass
class SDXLOptions:
    """Options of SDXL: the pipeline's micro-conditioning, guidance rescale and empty-prompt handling."""

    original_size: tuple[int, int] | None = None
    """`(height, width)` of the size micro-conditioning `add_time_ids` (None: the image size, as the pipeline)."""
    crops_coords_top_left: tuple[int, int] = (0, 0)
    """`(top, left)` of the crop micro-conditioning (the pipeline's default `(0, 0)`)."""
    target_size: tuple[int, int] | None = None
    """`(height, width)` of the target-size micro-conditioning (None: the image size, as the pipeline)."""
    guidance_rescale: float = 0.0
    """CFG rescale (Lin et al. 2023, arXiv:2305.08891, eq. 15-16; the pipeline's `guidance_rescale`, default 0)."""
    force_zeros_for_empty_prompt: bool | None = None
    """An empty negative prompt (the default) is all-zero embeddings instead of the encoding of `""`, as the
    pipeline called without a negative prompt (None: the pipeline's `force_zeros_for_empty_prompt` config, True for
    SDXL base; False: the pipeline called with `negative_prompt=""`). An empty prompt is always encoded."""


@register_family
class SDXLAdapter(UNetAdapter):
    """Stable Diffusion XL: `UNet2DConditionModel` with text-time embeddings, CLIP-L + CLIP-G, DDIM (DDPO's sampler).

    Epsilon prediction sampled with a `DDIMScheduler` built from the pipeline's scheduler config (SDXL ships
    Euler), as the `unet` family. The pooled CLIP-G embedding and the size/crop `add_time_ids` go to the UNet's
    `added_cond_kwargs`; the negative prompt `""` is zeros when `force_zeros_for_empty_prompt` (SDXL's call with no
    negative prompt), so negative prompts are encoded apart from prompts (`negative_differs`).
    """

    family = "sdxl"
    Options = SDXLOptions
    pipeline_class = "StableDiffusionXLPipeline"
    real_models = ("stabilityai/stable-diffusion-xl-base-1.0: 2.6B (UNet)",)
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    """diffusers' SDXL LoRA scripts (`train_text_to_image_lora_sdxl.py`, `train_dreambooth_lora_sdxl.py`): the UNet
    attention projections."""
    lora_prefix = "unet"
    negative_differs = True

    def __init__(self, pipeline, *, options=None):
        super().__init__(pipeline, options=options)
        from diffusers import DDIMScheduler

        source = pipeline.scheduler.config
        # an SDXL Euler config written without DDIM's keys would get DDIM's defaults (x0 clipped to [-1, 1], final
        # alpha 1): SD latents are not in [-1, 1], and SD/SDXL schedules use set_alpha_to_one=False
        fixes = {k: False for k in ("clip_sample", "set_alpha_to_one") if k not in source}
        if fixes and not isinstance(pipeline.scheduler, DDIMScheduler):
            self.scheduler = DDIMScheduler.from_config(source, **fixes)

    def encode(self, prompts):
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, do_classifier_free_guidance=False
        )
        return {"prompt_embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def encode_negative(self, prompts):
        """As `encode`, but an empty prompt is zeros when `force_zeros_for_empty_prompt` (the pipeline's
        `zero_out_negative_prompt`)."""
        cond = self.encode(prompts)
        flag = self.options.force_zeros_for_empty_prompt
        if flag is None:
            flag = self.pipeline.config.get("force_zeros_for_empty_prompt", False)
        if flag:
            empty = torch.tensor([p == "" for p in prompts], device=self.device)
            cond = {k: v.masked_fill(empty.to(v.device).view(-1, *[1] * (v.dim() - 1)), 0) for k, v in cond.items()}
        return cond

    def static_inputs(self, height, width):
        """The pipeline's `add_time_ids [1, 6]`: original size, crop top-left, target size."""
        pipe, options = self.pipeline, self.options
        size = (int(height), int(width))
        if pipe.text_encoder_2 is not None:
            projection = pipe.text_encoder_2.config.projection_dim
        else:
            config = self.model.config
            projection = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        time_ids = pipe._get_add_time_ids(
            tuple(options.original_size or size),
            tuple(options.crops_coords_top_left),
            tuple(options.target_size or size),
            dtype=self.dtype,
            text_encoder_projection_dim=projection,
        )
        return {"time_ids": time_ids.to(self.device)}

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        if not static:
            vsf = self.pipeline.vae_scale_factor
            static = self.static_inputs(latents.shape[-2] * vsf, latents.shape[-1] * vsf)
        n = latents.shape[0]
        latents = self.scheduler.scale_model_input(latents, timesteps)
        added = {"text_embeds": cond["pooled"], "time_ids": static["time_ids"].to(latents.device).expand(n, -1)}
        return (model or self.model)(
            latents,
            timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            added_cond_kwargs=added,
            return_dict=False,
        )[0]

    def combine_cfg(self, uncond, text, guidance_scale):
        guided = uncond + guidance_scale * (text - uncond)
        if self.options.guidance_rescale > 0:
            from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import rescale_noise_cfg

            guided = rescale_noise_cfg(guided, text, guidance_rescale=self.options.guidance_rescale)
        return guided

    def initial_latents(self, batch_size, height, width, generator):
        """The pipeline's `prepare_latents`, scaled by the DDIM scheduler's `init_noise_sigma` (1), not by the
        pipeline scheduler's (Euler's is ~14.6)."""
        from diffusers.utils.torch_utils import randn_tensor

        vsf = self.pipeline.vae_scale_factor
        shape = (batch_size, self.model.config.in_channels, int(height) // vsf, int(width) // vsf)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=self.dtype)
        return latents * self.scheduler.init_noise_sigma

    def decode(self, latents, height, width):
        """As the pipeline: an fp16 VAE with `force_upcast` decodes in fp32; `latents_mean`/`latents_std` when set."""
        pipe = self.pipeline
        vae = pipe.vae
        upcast = vae.dtype == torch.float16 and vae.config.get("force_upcast", False)
        if upcast:
            vae.to(dtype=torch.float32)
        try:
            latents = latents.to(vae.dtype)
            mean, std = vae.config.get("latents_mean"), vae.config.get("latents_std")
            if mean is not None and std is not None:
                mean = torch.tensor(mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
                std = torch.tensor(std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
                latents = latents * std / vae.config.scaling_factor + mean
            else:
                latents = latents / vae.config.scaling_factor
            image = vae.decode(latents, return_dict=False)[0]
        finally:
            if upcast:
                vae.to(dtype=torch.float16)
        if pipe.watermark is not None:
            image = pipe.watermark.apply_watermark(image)
        return pipe.image_processor.postprocess(image, output_type="pt")

    @staticmethod
    def tiny(seed: int = 0):
        """A `StableDiffusionXLPipeline`: a tiny text-time `UNet2DConditionModel`, CLIP + CLIP-with-projection, a
        2-level VAE and a `DDIMScheduler`. 64x64 images map to 4x32x32 latents."""
        from diffusers import DDIMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

        tokenizer = tiny_clip_tokenizer()
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=32,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(8, 16),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            transformer_layers_per_block=(1, 2),
            projection_class_embeddings_input_dim=6 * 8 + 32,  # 6 time ids x 8 + CLIP-G projection
            cross_attention_dim=64,  # = CLIP-L hidden + CLIP-G hidden
            norm_num_groups=4,
        )
        torch.manual_seed(seed + 1)
        text_encoder = _clip_text_encoder(tokenizer, with_projection=False)
        torch.manual_seed(seed + 2)
        text_encoder_2 = _clip_text_encoder(tokenizer, projection=32)
        torch.manual_seed(seed + 3)
        vae = _vae(4, shift=None, scale=0.13025)
        scheduler = DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
            timestep_spacing="leading",
        )
        return _eval(
            StableDiffusionXLPipeline(
                vae=vae,
                text_encoder=text_encoder,
                text_encoder_2=text_encoder_2,
                tokenizer=tokenizer,
                tokenizer_2=tokenizer,
                unet=unet,
                scheduler=scheduler,
                force_zeros_for_empty_prompt=True,
                add_watermarker=False,
            )
        )
