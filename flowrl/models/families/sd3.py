"""Stable Diffusion 3 / 3.5: the adapter, its options and a tiny offline `StableDiffusion3Pipeline`."""

from __future__ import annotations

import torch

from flowrl.models.adapter import ModelAdapter, TextEncoderOptions
from flowrl.models.families import register_family
from flowrl.models.helpers import decode_vae, dynamic_shift, text_kwargs
from flowrl.models.tiny import _clip_text_encoder, _eval, _t5_encoder, _vae, tiny_clip_tokenizer, tiny_t5_tokenizer


@register_family
class SD3Adapter(ModelAdapter):
    """Stable Diffusion 3 / 3.5: `SD3Transformer2DModel`, CLIP-L + CLIP-G + T5, flow matching."""

    family = "sd3"
    Options = TextEncoderOptions
    pipeline_class = "StableDiffusion3Pipeline"
    real_models = ("stabilityai/stable-diffusion-3.5-medium: 2.5B", "stabilityai/stable-diffusion-3.5-large: 8.1B")
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    """Flow-GRPO's SD3 set: the attention projections of both streams."""

    @property
    def model(self):
        return self.pipeline.transformer

    def encode(self, prompts):
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            **text_kwargs(self.options),
        )
        return {"prompt_embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        return (model or self.model)(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled"],
            return_dict=False,
        )[0]

    def schedule(self, num_steps, latent_shape):
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

        mu = self.shift_mu(latent_shape)
        kwargs = {} if mu is None else {"mu": mu}
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, "cpu", **kwargs)
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def shift_mu(self, latent_shape):
        patch = self.model.config.patch_size
        seq_len = (latent_shape[-2] // patch) * (latent_shape[-1] // patch)
        return dynamic_shift(self.scheduler.config, seq_len, max_shift=1.16)  # SD3's pipeline falls back to 1.16

    def decode(self, latents, height, width):
        return decode_vae(self.pipeline, latents)

    @staticmethod
    def tiny(seed: int = 0, latent_channels: int = 16):
        """A `StableDiffusion3Pipeline` with a 2-layer `SD3Transformer2DModel`, tiny CLIP x2 + T5 and a 2-level VAE.

        64x64 images map to 16x32x32 latents (or `latent_channels`).
        """
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

        tokenizer, tokenizer_3 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=32,
            patch_size=2,
            in_channels=latent_channels,
            out_channels=latent_channels,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=64,  # = T5 d_model
            caption_projection_dim=64,
            pooled_projection_dim=64,  # = 2 x CLIP projection
            pos_embed_max_size=32,
        )
        torch.manual_seed(seed + 1)
        text_encoder = _clip_text_encoder(tokenizer)
        torch.manual_seed(seed + 2)
        text_encoder_2 = _clip_text_encoder(tokenizer)
        torch.manual_seed(seed + 3)
        text_encoder_3 = _t5_encoder(tokenizer_3, 64)
        torch.manual_seed(seed + 4)
        vae = _vae(latent_channels, shift=0.0609, scale=1.5035)
        return _eval(
            StableDiffusion3Pipeline(
                transformer=transformer,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                vae=vae,
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                text_encoder_2=text_encoder_2,
                tokenizer_2=tokenizer,
                text_encoder_3=text_encoder_3,
                tokenizer_3=tokenizer_3,
            )
        )
