"""HunyuanVideo 1.5 image-to-video: the adapter and a tiny offline `HunyuanVideo15ImageToVideoPipeline`.

A sample is a (prompt, start image) pair; the start image is a conditioning image (`flowrl.policies.sources`, the
mechanism editing models use), prepared at the video's size. As `HunyuanVideo15ImageToVideoPipeline` conditions on
it: the image is resized (center crop) to the video's size, VAE-encoded (the latent mode, scaled) as the first
latent frame of the condition the network sees concatenated on channels (later frames zero) with a mask that marks
that frame (`in_channels = 2 C + 1`, the text-to-video family's layout with a real condition), and its SigLIP
embeddings (the vision tower's last hidden state) go to the transformer's image embedder instead of the zeros of
text-to-video. Every latent element is generated, as in the pipeline. Text, guidance (the guider) and the schedule
are HunyuanVideo 1.5's (`flowrl.models.families.hunyuan_video`).

Size: the pipeline picks the video's size from the start image (the bucket of its aspect ratio at the transformer's
`target_size`, 480p: e.g. 480 x 848 for 16:9) and crops the image to it; flowrl samples at the run's `height` x
`width` and crops the image to that, so a run matches the pipeline when its size is the image's bucket
(`default_size` is the 16:9 one). The step-distilled checkpoint (`use_meanflow`, whose network also takes the next
timestep) is not supported.
"""

from __future__ import annotations

import torch

from flowrl.models.families import register_family
from flowrl.models.families.hunyuan_video import HunyuanVideoAdapter
from flowrl.models.families.qwen_image_edit import _as_pil
from flowrl.models.tiny import _eval


@register_family
class HunyuanVideoI2VAdapter(HunyuanVideoAdapter):
    """HunyuanVideo 1.5 image-to-video: HunyuanVideo 1.5 conditioned on a start image (latent and SigLIP embeddings).

    Options, text encoders and guidance as `hunyuan_video`; each prompt comes with its start image (a prompt set's
    `image`, or `flowrl sample --image`), center-cropped to the video's size as the pipeline crops it.
    """

    family = "hunyuan_video_i2v"
    pipeline_class = "HunyuanVideo15ImageToVideoPipeline"
    conditioning = "start_frame"
    conditions_at_size = True
    pipeline_needs_sources = True
    real_models = ("hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v: 8.3B (+ SigLIP image encoder 0.4B)",)
    """The diffusers conversion named in `HunyuanVideo15ImageToVideoPipeline`'s docstring; 8.3B is the model card's."""

    def __init__(self, pipeline, *, options=None):
        if pipeline.transformer.config.get("use_meanflow", False):
            raise ValueError(
                "this HunyuanVideo 1.5 image-to-video checkpoint is step-distilled (use_meanflow: the "
                "network also takes the next timestep); flowrl supports the undistilled ones"
            )
        super().__init__(pipeline, options=options)

    def prepare_sources(self, images, size=None):
        """The pipeline's resize (`video_processor.resize(..., resize_mode="crop")`) of the start image to the video's
        `size`: `(pixels [1, 3, H, W] in [0, 1], the resized PIL image)`."""
        if len(images) != 1:
            raise ValueError(f"{self.family} starts a video from one image per prompt, got {len(images)}")
        height, width = size if size is not None else self.default_size()
        multiple = self.pipeline.vae_scale_factor_spatial
        if height % multiple or width % multiple:
            raise ValueError(f"{self.family} needs a height and width divisible by {multiple}, got {height} x {width}")
        processor = self.pipeline.video_processor
        image = processor.resize(_as_pil(images[0]), height=height, width=width, resize_mode="crop")
        pixels = processor.preprocess(image, height=height, width=width).to(torch.float32)
        return (pixels / 2 + 0.5).clamp(0, 1), image

    def encode_sources(self, prompt, inputs):
        """`prepare_cond_latents_and_mask` and `encode_image` of `HunyuanVideo15ImageToVideoPipeline` on one resized
        start image, unbatched: `condition [C + 1, F', h, w]` (the scaled image latent on the first latent frame,
        zeros after it, then the first-frame mask) and `image_embeds [L, D]` (SigLIP). The prompt does not enter."""
        pipe, image = self.pipeline, inputs
        height, width = image.size[1], image.size[0]
        latent = pipe._get_image_latents(pipe.vae, pipe.video_processor, image, height, width, self.device)
        frames = (self.options.num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        condition = latent.repeat(1, 1, frames, 1, 1)
        condition[:, :, 1:] = 0
        mask = torch.zeros_like(condition[:, :1])
        mask[:, :, 0] = 1.0
        embeds = pipe._get_image_embeds(pipe.image_encoder, pipe.feature_extractor, image, self.device)
        return {
            "condition": torch.cat([condition, mask], dim=1)[0].to(self.dtype),
            "image_embeds": embeds[0].to(self.dtype),
        }

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        """The velocity `[N, C, F', h, w]`: the network on `[latents, condition, mask]` with the start image's SigLIP
        embeddings, at the raw timestep."""
        if "condition" not in cond:
            raise ValueError(
                f"{self.family} needs a start image with every prompt (a prompt set with an `image` per "
                "row, or `flowrl sample --image`)"
            )
        return (model or self.model)(
            hidden_states=torch.cat([latents, cond["condition"].to(latents.dtype)], dim=1),
            image_embeds=cond["image_embeds"].to(latents.dtype),
            timestep=timesteps.to(latents.dtype),
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_attention_mask=cond["prompt_embeds_mask"],
            encoder_hidden_states_2=cond["prompt_embeds_2"],
            encoder_attention_mask_2=cond["prompt_embeds_mask_2"],
            return_dict=False,
        )[0]

    def default_size(self):
        """The 16:9 bucket at `transformer.config.target_size` (480p: 480 x 848), the text-to-video pipeline's default
        (the image-to-video pipeline takes the start image's bucket)."""
        pipe = self.pipeline
        return tuple(pipe.video_processor.calculate_default_height_width(9, 16, pipe.target_size))

    @staticmethod
    def tiny(seed: int = 0):
        """A `HunyuanVideo15ImageToVideoPipeline` over the tiny HunyuanVideo 1.5 components (`HunyuanVideoAdapter.tiny`
        with an `"i2v"` transformer: 64x64, 5 frames -> latents 4x2x4x4) and a 1-layer SigLIP vision tower (32 px,
        hidden size 12: the transformer's `image_embed_dim`) with its image processor."""
        from diffusers import HunyuanVideo15ImageToVideoPipeline
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        base = HunyuanVideoAdapter.tiny(seed=seed, task_type="i2v")
        torch.manual_seed(seed + 4)
        image_encoder = SiglipVisionModel(
            SiglipVisionConfig(
                hidden_size=12,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            )
        )
        feature_extractor = SiglipImageProcessor(size={"height": 32, "width": 32})
        return _eval(
            HunyuanVideo15ImageToVideoPipeline(
                **base.components, image_encoder=image_encoder, feature_extractor=feature_extractor
            )
        )
