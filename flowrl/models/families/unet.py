"""SD1.x / SD2.x UNets with DDIM (DDPO's sampler): the adapter and a tiny offline `StableDiffusionPipeline`."""

from __future__ import annotations

import torch

from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.helpers import ddim_schedule, decode_vae
from flowrl.models.tiny import _clip_text_encoder, _eval, _vae, tiny_clip_tokenizer


@register_family
class UNetAdapter(ModelAdapter):
    """SD1.x / SD2.x: `UNet2DConditionModel` with a DDIM scheduler (DDPO's sampler)."""

    family = "unet"
    pipeline_class = "StableDiffusionPipeline"
    real_models = ("stable-diffusion-v1-5/stable-diffusion-v1-5: 0.86B", "stabilityai/stable-diffusion-2-1: 0.87B")
    lora_prefix = "unet"
    time_kind = "ddim"
    default_sampler = "ddim"

    def __init__(self, pipeline, *, options=None):
        super().__init__(pipeline, options=options)
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

    def schedule(self, num_steps, latent_shape):
        return ddim_schedule(self.scheduler, num_steps)

    def decode(self, latents, height, width):
        return decode_vae(self.pipeline, latents, shift=False)

    @staticmethod
    def tiny(seed: int = 0):
        """A `StableDiffusionPipeline`: a tiny `UNet2DConditionModel`, CLIP text encoder, VAE and `DDIMScheduler`."""
        from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

        tokenizer = tiny_clip_tokenizer()
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=32,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(16, 32),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=8,
        )
        torch.manual_seed(seed + 1)
        text_encoder = _clip_text_encoder(tokenizer, with_projection=False)
        torch.manual_seed(seed + 2)
        vae = _vae(4, shift=None, scale=0.18215)
        scheduler = DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        )
        return _eval(
            StableDiffusionPipeline(
                unet=unet,
                scheduler=scheduler,
                vae=vae,
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
        )
