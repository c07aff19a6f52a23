"""Flux.1: the adapter (packed latents, guidance embedding), its options and a tiny offline `FluxPipeline`."""

from __future__ import annotations

import numpy as np
import torch

from flowrl.models.adapter import ModelAdapter, TextEncoderOptions
from flowrl.models.families import register_family
from flowrl.models.helpers import decode_vae, dynamic_shift, flux_forward, guidance_embedding, text_kwargs
from flowrl.models.tiny import _clip_text_encoder, _eval, _t5_encoder, _vae, tiny_clip_tokenizer, tiny_t5_tokenizer


@register_family
class FluxAdapter(ModelAdapter):
    """Flux.1: `FluxTransformer2DModel` on 2x2-packed latents with image ids; guidance is an embedding.

    Flux.1-dev is guidance-distilled: `guidance_scale` is fed to the guidance embedding (no second CFG
    branch), exactly as `FluxPipeline` does.
    """

    family = "flux"
    Options = TextEncoderOptions
    pipeline_class = "FluxPipeline"
    real_models = ("black-forest-labs/FLUX.1-dev: 12B", "black-forest-labs/FLUX.1-schnell: 12B")
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    packed_latents = True

    @property
    def model(self):
        return self.pipeline.transformer

    def uses_cfg(self, guidance_scale):
        return False

    def encode(self, prompts):
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, **text_kwargs(self.options)
        )
        return {"prompt_embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    def static_inputs(self, height, width):
        vsf = self.pipeline.vae_scale_factor
        h, w = 2 * (int(height) // (vsf * 2)), 2 * (int(width) // (vsf * 2))
        return {"img_ids": self.pipeline._prepare_latent_image_ids(1, h // 2, w // 2, self.device, self.dtype)}

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        return flux_forward(
            model or self.model,
            latents,
            timesteps,
            guidance_embedding(self.model, guidance_scale, latents.shape[0], latents.device),
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=torch.zeros(cond["prompt_embeds"].shape[1], 3, device=latents.device, dtype=latents.dtype),
            img_ids=static["img_ids"],
        )

    def schedule(self, num_steps, latent_shape):
        from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if self.scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        mu = self.shift_mu(latent_shape)
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def shift_mu(self, latent_shape):
        return dynamic_shift(self.scheduler.config, latent_shape[1])  # packed tokens: the pipeline's image_seq_len

    def decode(self, latents, height, width):
        spatial = self.pipeline._unpack_latents(latents, height, width, self.pipeline.vae_scale_factor)
        return decode_vae(self.pipeline, spatial)

    @staticmethod
    def tiny(seed: int = 0, latent_channels: int = 16):
        """A `FluxPipeline` with a 1+1-block `FluxTransformer2DModel` (guidance embedding on), tiny CLIP + T5, VAE."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

        tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * latent_channels,  # 2x2 packed latents
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,  # = T5 d_model
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),  # sums to the head dim
        )
        torch.manual_seed(seed + 1)
        text_encoder = _clip_text_encoder(tokenizer, with_projection=False)
        torch.manual_seed(seed + 2)
        text_encoder_2 = _t5_encoder(tokenizer_2, 32)
        torch.manual_seed(seed + 3)
        vae = _vae(latent_channels, shift=0.1159, scale=0.3611)
        return _eval(
            FluxPipeline(
                transformer=transformer,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
                vae=vae,
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                text_encoder_2=text_encoder_2,
                tokenizer_2=tokenizer_2,
            )
        )
