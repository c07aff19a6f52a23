"""Wan image-to-video (2.1 I2V, 2.2 I2V-A14B, TI2V-5B): the adapter and a tiny offline `WanImageToVideoPipeline`.

A sample is a (prompt, start image) pair: the start image is a conditioning image (`flowrl.policies.sources`, the
mechanism editing models use), prepared at the video's size. As `WanImageToVideoPipeline` conditions on it:

- Wan 2.1 I2V and Wan 2.2 I2V-A14B: the image, followed by `F - 1` black frames, is VAE-encoded (the latent mode,
  normalised) and concatenated on channels after the noisy latents with a 4-channel mask that marks the first frame
  (`in_channels` 16 + 4 + 16 = 36); Wan 2.1 also sees the image's CLIP ViT-H embeddings (the penultimate layer's
  hidden states) in its image cross-attention. Every latent element is generated (the first frame too).
- TI2V-5B (`expand_timesteps`): the image's latent is the video's first latent frame and its tokens see timestep 0;
  the pipeline denoises the rest and puts the image latent back before decoding. Here the state holds the image
  latent as its first frame from the start (`place_conditions`), its velocity is 0 and its elements follow the ODE
  on every step (`ode_elements`: no noise, no log-probability: it is not the policy's action), so the decoded video
  is the pipeline's and no gradient flows through the prediction the pipeline discards.

The two experts of Wan 2.2 and every option are Wan's (`flowrl.models.families.wan`). The TI2V-5B checkpoint's
folder names `WanPipeline`: load it as this family with `model.family: wan_i2v`.
"""

from __future__ import annotations

import importlib.util

import torch
from diffusers.utils.torch_utils import randn_tensor

from flowrl.models.families import register_family
from flowrl.models.families.qwen_image_edit import _as_pil
from flowrl.models.families.wan import WanAdapter
from flowrl.models.tiny import _eval, tiny_t5_tokenizer


@register_family
class WanI2VAdapter(WanAdapter):
    """Wan image-to-video (2.1 I2V, 2.2 I2V-A14B, TI2V-5B): Wan conditioned on a start image per prompt.

    Options and experts as `wan`; each prompt comes with its start image (a prompt set's `image`, or
    `flowrl sample --image`), resized to the video's size as the pipeline resizes it.
    """

    family = "wan_i2v"
    pipeline_class = "WanImageToVideoPipeline"
    conditioning = "start_frame"
    conditions_at_size = True
    pipeline_needs_sources = True
    real_models = (
        "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers: 16.4B (the card's 14B and its image cross-attention; + CLIP 0.6B)",
        "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers: 16.4B (the card's 14B and its image cross-attention; + CLIP 0.6B)",
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers: 2 x 14B experts (one or both train)",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers: 5B (the wan checkpoint, loaded with model.family wan_i2v)",
    )
    """Wan2.2-TI2V-5B's folder names `WanPipeline` (family `wan`); diffusers loads the image-to-video pipeline from the
    same folder, so it runs here with `model.family: wan_i2v`."""

    @property
    def expands_timesteps(self) -> bool:
        """TI2V-5B: the start frame's latent is part of the state (a timestep per token)."""
        return bool(self.pipeline.config.expand_timesteps)

    def encode(self, prompts):
        # diffusers 0.42's WanImageToVideoPipeline cleans every prompt with ftfy, imported only where installed: its
        # absence surfaces as "NameError: name 'ftfy' is not defined" deep in the pipeline
        if importlib.util.find_spec("ftfy") is None:
            raise ImportError("the wan_i2v family needs ftfy to encode prompts: pip install 'flowrl-toolkit[video]'")
        return super().encode(prompts)

    # ----- the start image -----

    def prepare_sources(self, images, size=None):
        """The pipeline's step 5 on the start image: `video_processor.preprocess` at the video's `size` (`(pixels
        [1, 3, H, W] in [0, 1], (the processed [1, 3, H, W] in [-1, 1], the image as given))`; the image as given is
        what Wan 2.1's CLIP processor sees, as the pipeline's `encode_image(image)`)."""
        if len(images) != 1:
            raise ValueError(f"{self.family} starts a video from one image per prompt, got {len(images)}")
        height, width = size if size is not None else self.default_size()
        if height % 16 or width % 16:
            raise ValueError(f"{self.family} needs a height and width divisible by 16, got {height} x {width}")
        image = _as_pil(images[0])
        processed = self.pipeline.video_processor.preprocess(image, height=height, width=width).to(torch.float32)
        return (processed / 2 + 0.5).clamp(0, 1), (processed, image)

    def encode_sources(self, prompt, inputs):
        """`WanImageToVideoPipeline.prepare_latents` (and `encode_image`) on one start image, unbatched: `condition`
        (`[4 + C, F', h, w]`: the first-frame mask and the normalised latents of the image followed by black frames;
        TI2V-5B: `[C, 1, h, w]`, the image's latent alone) and, for Wan 2.1, `image_embeds [257, D]`. The prompt does
        not enter."""
        pipe, (image, original) = self.pipeline, inputs
        vae, frames = pipe.vae, self.options.num_frames
        image = image.to(self.device).unsqueeze(2)  # [1, 3, 1, H, W]
        if not self.expands_timesteps:  # the image, then black frames
            image = torch.cat([image, image.new_zeros(1, 3, frames - 1, *image.shape[-2:])], dim=2)
        latent = vae.encode(image.to(vae.dtype)).latent_dist.mode().to(torch.float32)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latent.device, latent.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latent.device, latent.dtype)
        latent = (latent - mean) * inv_std
        if self.expands_timesteps:
            return {"condition": latent[0].to(self.dtype)}
        scale = pipe.vae_scale_factor_temporal
        mask = torch.ones(1, 1, frames, *latent.shape[-2:], device=latent.device)
        mask[:, :, 1:] = 0
        mask = torch.cat([mask[:, :, :1].repeat_interleave(scale, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, -1, scale, *latent.shape[-2:]).transpose(1, 2)  # [1, 4, F', h, w]
        cond = {"condition": torch.cat([mask, latent], dim=1)[0].to(self.dtype)}
        if self.model_config.image_dim is not None:  # Wan 2.1: CLIP ViT-H image embeddings
            cond["image_embeds"] = pipe.encode_image(original, self.device)[0].to(self.dtype)
        return cond

    @property
    def model_config(self):
        """The high-noise expert's config (the pipeline reads `image_dim` from it)."""
        return (self.pipeline.transformer or self.pipeline.transformer_2).config

    # ----- the state -----

    def initial_latents(self, batch_size, height, width, generator):
        """`[B, C, F', h, w]` drawn in fp32 as the pipeline's `prepare_latents` draws them, then in the model's
        dtype."""
        pipe = self.pipeline
        frames = (self.options.num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        scale = pipe.vae_scale_factor_spatial
        shape = (batch_size, pipe.vae.config.z_dim, frames, height // scale, width // scale)
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)
        return latents.to(self.dtype)

    def place_conditions(self, latents, cond):
        """TI2V-5B: the start image's latent as the first latent frame (the pipeline's `(1 - first_frame_mask) *
        condition + first_frame_mask * latents`)."""
        if not self.expands_timesteps or "condition" not in cond:
            return latents
        return torch.cat([cond["condition"].to(latents), latents[:, :, 1:]], dim=2)

    def ode_elements(self, latents):
        """TI2V-5B: the first latent frame (the start image's latent); None for Wan 2.1 / 2.2 A14B."""
        if not self.expands_timesteps or latents.ndim != 5:
            return None
        fixed = torch.zeros(latents.shape[1:], dtype=torch.bool)  # host data: from the shape
        fixed[:, 0] = True
        return fixed

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        """Wan's velocity with the start image's conditioning (TI2V-5B: 0 on the start frame, which the pipeline
        replaces by the image latent)."""
        if "condition" not in cond:
            raise ValueError(
                f"{self.family} needs a start image with every prompt (a prompt set with an `image` per "
                "row, or `flowrl sample --image`)"
            )
        out = super().forward(latents, timesteps, cond, guidance_scale, model=model, static=static)
        if self.expands_timesteps:
            out = torch.cat([torch.zeros_like(out[:, :, :1]), out[:, :, 1:]], dim=2)
        return out

    @staticmethod
    def tiny(seed: int = 0, variant: str = "2.1"):
        """A `WanImageToVideoPipeline` at diffusers' test sizes: the tiny Wan pieces (`WanAdapter.tiny`: 2-layer
        transformer, UMT5, 3-level VAE: 64x64, 5 frames -> latents 16x2x8x8) with image conditioning.

        `variant`: `"2.1"` (a 2-layer CLIP vision tower and `image_dim` 4, `in_channels` 36), `"2.2"` (I2V-A14B: two
        experts, no image encoder, `boundary_ratio` 0.875) or `"ti2v"` (TI2V-5B: `expand_timesteps`, `in_channels`
        16, no image encoder).
        """
        from diffusers import (
            AutoencoderKLWan,
            FlowMatchEulerDiscreteScheduler,
            WanImageToVideoPipeline,
            WanTransformer3DModel,
        )
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

        if variant not in ("2.1", "2.2", "ti2v"):
            raise ValueError(f"variant must be '2.1', '2.2' or 'ti2v', got {variant!r}")
        tokenizer = tiny_t5_tokenizer()

        def transformer():
            return WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=2,
                attention_head_dim=12,
                in_channels=16 if variant == "ti2v" else 36,
                out_channels=16,
                text_dim=32,
                freq_dim=256,
                ffn_dim=32,
                num_layers=2,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                rope_max_seq_len=32,
                image_dim=4 if variant == "2.1" else None,
            )

        torch.manual_seed(seed)
        high = transformer()
        torch.manual_seed(seed + 1)
        low = transformer() if variant == "2.2" else None
        torch.manual_seed(seed + 2)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=32,
                d_ff=37,
                d_kv=8,
                num_layers=2,
                num_heads=4,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=0,
            )
        )
        torch.manual_seed(seed + 3)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
        torch.manual_seed(seed + 4)
        image_encoder = image_processor = None
        if variant == "2.1":
            image_encoder = CLIPVisionModel(
                CLIPVisionConfig(
                    hidden_size=4,
                    projection_dim=4,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    image_size=32,
                    intermediate_size=16,
                    patch_size=1,
                )
            )
            image_processor = CLIPImageProcessor(crop_size=32, size=32)
        return _eval(
            WanImageToVideoPipeline(
                tokenizer=tokenizer,
                text_encoder=text_encoder,
                vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                image_processor=image_processor,
                image_encoder=image_encoder,
                transformer=high,
                transformer_2=low,
                boundary_ratio=0.875 if variant == "2.2" else None,
                expand_timesteps=variant == "ti2v",
            )
        )
