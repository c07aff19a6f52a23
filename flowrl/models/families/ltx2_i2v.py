"""LTX-2 image-to-video (with audio): the adapter and a tiny offline `LTX2ImageToVideoPipeline`.

LTX-2 (`flowrl.models.families.ltx2`: the video branch trains, the audio latents follow the ODE untouched) with a
start image per prompt, a conditioning image (`flowrl.policies.sources`, the mechanism editing models use) prepared at
the video's size. As `LTX2ImageToVideoPipeline` does, the image is encoded by the video VAE into the first latent
frame; those tokens sit clean in the state from the start (`place_conditions`), see timestep 0, have velocity 0 and
follow the ODE (`ode_elements`: they stay the image latent and are not part of the policy's action), so the pipeline's
"step every frame but the first" is reproduced exactly. The checkpoint is LTX-2's own (`Lightricks/LTX-2`): load it
with `model.family: ltx2_i2v`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from flowrl.models.families import register_family
from flowrl.models.families.ltx2 import LTX2Adapter, LTX2Options
from flowrl.models.families.qwen_image_edit import _as_pil


@dataclasses.dataclass
class LTX2I2VOptions(LTX2Options):
    """Options of LTX-2 image-to-video (`model.options`)."""

    image_crf: int | None = None
    """H.264 re-compression of the start image before it is encoded (the pipeline's `image_crf`: its training
    compression, with PyAV from the `video` extra): None is the pipeline's default (33 for the Gemma 3 checkpoints), 0
    skips it."""


@register_family
class LTX2I2VAdapter(LTX2Adapter):
    """LTX-2 image-to-video (with audio): LTX-2 whose first latent frame is the start image's latent, kept clean.

    Options as `ltx2` plus `image_crf`; each prompt comes with its start image (a prompt set's `image`, or
    `flowrl sample --image`), resized to the video's size as the pipeline resizes it.
    """

    family = "ltx2_i2v"
    Options = LTX2I2VOptions
    pipeline_class = "LTX2ImageToVideoPipeline"
    conditioning = "start_frame"
    conditions_at_size = True
    pipeline_needs_sources = True
    real_models = ("Lightricks/LTX-2: 19B (the ltx2 checkpoint, loaded with model.family ltx2_i2v)",)
    """LTX-2's folder names `LTX2Pipeline` (family `ltx2`); diffusers loads the image-to-video pipeline from the same
    folder, so it runs here with `model.family: ltx2_i2v`."""

    def prepare_sources(self, images, size=None):
        """The pipeline's start image: H.264 re-compressed at `image_crf` (0: not), then
        `video_processor.preprocess` at the video's `size`: `(pixels [1, 3, H, W] in [0, 1], the processed image)`."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf

        if len(images) != 1:
            raise ValueError(f"{self.family} starts a video from one image per prompt, got {len(images)}")
        height, width = size if size is not None else self.default_size()
        image = _as_pil(images[0])
        crf = self.options.image_crf
        crf = resolve_default_image_crf(self.pipeline.text_encoder) if crf is None else crf
        if crf:
            from PIL import Image

            image = Image.fromarray(apply_image_conditioning_crf(np.array(image), crf))
        processed = self.pipeline.video_processor.preprocess(image, height=height, width=width).to(torch.float32)
        return (processed / 2 + 0.5).clamp(0, 1), processed

    def encode_sources(self, prompt, inputs):
        """`LTX2ImageToVideoPipeline.prepare_latents` on one start image: its normalised latent mode, packed, the
        first latent frame's tokens flattened (`start_latents [h w C]`). The prompt does not enter."""
        pipe = self.pipeline
        image = inputs.to(self.device, self.pipeline.text_encoder.dtype)
        latent = pipe.vae.encode(image.unsqueeze(2)).latent_dist.mode().to(torch.float32)
        latent = pipe._normalize_latents(latent, pipe.vae.latents_mean, pipe.vae.latents_std)
        packed = pipe._pack_latents(latent, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        return {"start_latents": packed[0].flatten().to(self.dtype)}

    def place_conditions(self, latents, cond):
        """The start image's latent tokens at the head of each state (the pipeline's `init_latents * mask + noise *
        (1 - mask)`: the first latent frame clean)."""
        if "start_latents" not in cond:
            return latents
        start = cond["start_latents"].to(latents)
        return torch.cat([start, latents[:, start.shape[1] :]], dim=1)

    def _first_frame_tokens(self, video_tokens: int) -> int:
        frames = (self.options.num_frames - 1) // self.pipeline.vae_temporal_compression_ratio + 1
        return video_tokens // frames

    def _video_timestep(self, timesteps, video_tokens: int):
        """`t (1 - conditioning_mask)` per video token: 0 on the start frame's tokens."""
        mask = torch.zeros(video_tokens, dtype=torch.float32, device=timesteps.device)
        mask[: self._first_frame_tokens(video_tokens)] = 1.0
        return timesteps.unsqueeze(-1) * (1 - mask)

    def _video_velocity(self, velocity):
        """0 on the start frame's tokens (the pipeline steps the other frames only)."""
        first = self._first_frame_tokens(velocity.shape[1])
        return torch.cat([torch.zeros_like(velocity[:, :first]), velocity[:, first:]], dim=1)

    def ode_elements(self, latents):
        """The start frame's latent tokens (the head of the state) and the audio latents (its tail)."""
        fixed = super().ode_elements(latents)
        if fixed is None:
            return None
        video_tokens = (latents.shape[1] - self.audio_size) // self.model.config.in_channels
        fixed[: self._first_frame_tokens(video_tokens) * self.model.config.in_channels] = True
        return fixed

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        if "start_latents" not in cond:
            raise ValueError(
                f"{self.family} needs a start image with every prompt (a prompt set with an `image` per "
                "row, or `flowrl sample --image`)"
            )
        return super().forward(latents, timesteps, cond, guidance_scale, model=model, static=static)
