"""HunyuanVideo 1.5 text-to-video: the adapter, its options and a tiny offline `HunyuanVideo15Pipeline`.

Shapes, as for Wan (`flowrl.models.families.wan`): videos are `[B, 3, F, H, W]` in [0, 1]; latents are
`[B, C, F', H/16, W/16]` with `F' = (F - 1) / 4 + 1` (the real VAE: 32 channels, 16x spatial, 4x temporal). The
network sees the latents concatenated on channels with the image-to-video condition (zeros for text-to-video) and its
mask (zeros): `in_channels = 2 C + 1`, as `HunyuanVideo15Pipeline.__call__` builds them, and zero image embeddings
(which the transformer takes as "text-to-video").

Text: Qwen2.5-VL (the prompt in a chat template with a system message, the hidden state two layers below the top,
the template's first `crop_start = 108` tokens dropped) and ByT5 on the prompt's quoted text ("glyphs"; zeros and
an all-zero mask when there is none). Both pad to fixed lengths with masks, so a prompt's conditioning never depends
on its batch.

CFG lives in the pipeline's `guider` (`ClassifierFreeGuidance`), not in a `__call__` argument: flowrl passes its own
`guidance_scale` and combines the two branches as the guider does (its `use_original_formulation` and
`guidance_rescale`); `set_pipeline_guidance` sets the guider's scale on a pipeline to sample the same. The pipeline
has no LoRA loader mixin: a flowrl LoRA loads with `pipe.transformer.load_lora_adapter(DIR, prefix="transformer")`
(`lora_loader`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math

import numpy as np
import torch

from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.tiny import _eval, _t5_encoder, byte_level_words, tiny_qwen2_tokenizer, whole_word_merges


logger = logging.getLogger(__name__)


@dataclasses.dataclass
class HunyuanVideoOptions:
    """Options of HunyuanVideo 1.5 (`model.options`)."""

    num_frames: int = 121
    """Frames per video F; `F - 1` must be divisible by the VAE's temporal factor (4): 1, 5, 9, ..., 121 (the
    pipeline's default). Latents hold `(F - 1) / 4 + 1` frames."""
    text_tokens: int | None = None
    """Qwen2.5-VL tokens kept per prompt after the template's `crop_start` prefix (None: the pipeline's
    `tokenizer_max_length`, 1000). Every prompt is padded to this length with a mask; the masked padding does not
    change the prediction but costs attention time, so a shorter length suits short prompts (a longer prompt is cut).
    (Not `max_sequence_length`: the pipeline's `__call__` has no such argument.)"""
    glyph_tokens: int | None = None
    """ByT5 tokens for the prompt's quoted text (None: the pipeline's `tokenizer_2_max_length`, 256)."""

    def __post_init__(self):
        if self.num_frames < 1 or (self.num_frames - 1) % 4:
            raise ValueError(
                f"model.options.num_frames must be 1, 5, 9, ... (F - 1 divisible by 4), got {self.num_frames}"
            )
        for name in ("text_tokens", "glyph_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"model.options.{name} must be >= 1 (or null: the pipeline's), got {value}")


@register_family
class HunyuanVideoAdapter(ModelAdapter):
    """HunyuanVideo 1.5 text-to-video: `HunyuanVideo15Transformer3DModel` on video latents, Qwen2.5-VL + ByT5, CFG.

    Latents `[B, C, F', h, w]`; `decode` returns videos `[B, 3, F, H, W]` in [0, 1] (`F = options.num_frames`). The
    timestep is the scheduler's raw one (0..1000), the sigmas `linspace(1, 0, N + 1)[:-1]` through the scheduler's
    static shift, as the pipeline's.
    """

    family = "hunyuan_video"
    attention_mask = "padded_square"
    Options = HunyuanVideoOptions
    pipeline_class = "HunyuanVideo15Pipeline"
    video = True
    real_models = ("hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v: 8.3B",)
    """The diffusers conversion named in `HunyuanVideo15Pipeline`'s docstring; 8.3B is the model card's size."""
    lora_targets = (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    )  # fmt: skip
    """No peer publishes a HunyuanVideo 1.5 LoRA set (Flow-Factory has no adapter for it; DanceGRPO fine-tunes
    HunyuanVideo v1 fully). These are the attention projections of both streams of every dual-stream block, the set
    Flow-GRPO uses for SD3 and DanceGRPO's Flux LoRA uses (without the MLPs, as theirs): the same kind of MMDiT block.
    `attn.to_q`/`to_k`/`to_v`/`to_out.0` also match the text token-refiner's self-attention (2 blocks)."""
    lora_loader = "transformer"

    def __init__(self, pipeline, *, options=None):
        super().__init__(pipeline, options=options)
        guider = pipeline.guider
        if guider.config.get("start", 0.0) != 0.0 or guider.config.get("stop", 1.0) != 1.0:
            logger.warning(
                "the pipeline's guider applies CFG only on part of the steps (start=%s, stop=%s); flowrl guides every "
                "step",
                guider.config.get("start"),
                guider.config.get("stop"),
            )

    @property
    def model(self):
        return self.pipeline.transformer

    # ------------------------------------------------------------------------------------------
    # guidance: the guider's
    # ------------------------------------------------------------------------------------------

    def uses_cfg(self, guidance_scale):
        """As `ClassifierFreeGuidance`: enabled unless the scale is the identity (1, or 0 in the original
        formulation) or the guider is disabled."""
        guider = self.pipeline.guider
        identity = 0.0 if guider.use_original_formulation else 1.0
        return bool(guider._enabled) and not math.isclose(guidance_scale, identity)

    def combine_cfg(self, uncond, text, guidance_scale):
        """`ClassifierFreeGuidance.forward` at flowrl's scale: `uncond + s (text - uncond)` (original formulation:
        `text + s (text - uncond)`), rescaled towards the conditional prediction's std by `guidance_rescale`."""
        from diffusers.guiders.guider_utils import rescale_noise_cfg

        guider = self.pipeline.guider
        pred = (text if guider.use_original_formulation else uncond) + guidance_scale * (text - uncond)
        if guider.guidance_rescale > 0.0:
            pred = rescale_noise_cfg(pred, text, guider.guidance_rescale)
        return pred

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, batch_size: int, negative_prompt: str = "") -> dict:
        """The negative prompt per video (the scale is the guider's: `set_pipeline_guidance`)."""
        return {"negative_prompt": [negative_prompt] * batch_size}

    @classmethod
    def set_pipeline_guidance(cls, pipeline, guidance_scale: float) -> None:
        """Give `pipeline` a copy of its guider at `guidance_scale` (its other settings kept)."""
        pipeline.guider = pipeline.guider.new(guidance_scale=guidance_scale)

    # ------------------------------------------------------------------------------------------
    # the adapter
    # ------------------------------------------------------------------------------------------

    @property
    def text_tokens(self) -> int:
        return self.options.text_tokens or self.pipeline.tokenizer_max_length

    @property
    def glyph_tokens(self) -> int:
        return self.options.glyph_tokens or self.pipeline.tokenizer_2_max_length

    def encode(self, prompts):
        """`HunyuanVideo15Pipeline.encode_prompt`'s four tensors: Qwen embeddings `[P, L, D]` and mask `[P, L]` (the
        template padded to `crop_start + text_tokens`, then cropped), ByT5 embeddings `[P, L2, D2]` and mask."""
        pipe = self.pipeline
        embeds, mask = pipe._get_mllm_prompt_embeds(
            text_encoder=pipe.text_encoder,
            tokenizer=pipe.tokenizer,
            prompt=list(prompts),
            device=self.device,
            tokenizer_max_length=self.text_tokens,
            system_message=pipe.system_message,
            crop_start=pipe.prompt_template_encode_start_idx,
        )
        embeds_2, mask_2 = pipe._get_byt5_prompt_embeds(
            tokenizer=pipe.tokenizer_2,
            text_encoder=pipe.text_encoder_2,
            prompt=list(prompts),
            device=self.device,
            tokenizer_max_length=self.glyph_tokens,
        )
        return {
            "prompt_embeds": embeds.to(self.dtype),
            "prompt_embeds_mask": mask.long(),
            "prompt_embeds_2": embeds_2.to(self.dtype),
            "prompt_embeds_mask_2": mask_2.long(),
        }

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        """The velocity `[N, C, F', h, w]`: the network on `[latents, zero condition, zero mask]` with zero image
        embeddings (text-to-video), at the raw timestep."""
        pipe = self.pipeline
        n = latents.shape[0]
        condition = torch.zeros_like(latents)
        mask = torch.zeros_like(latents[:, :1])
        image_embeds = torch.zeros(
            n, pipe.vision_num_semantic_tokens, pipe.vision_states_dim, dtype=latents.dtype, device=latents.device
        )
        return (model or self.model)(
            hidden_states=torch.cat([latents, condition, mask], dim=1),
            image_embeds=image_embeds,
            timestep=timesteps.to(latents.dtype),
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_attention_mask=cond["prompt_embeds_mask"],
            encoder_hidden_states_2=cond["prompt_embeds_2"],
            encoder_attention_mask_2=cond["prompt_embeds_mask_2"],
            return_dict=False,
        )[0]

    def initial_latents(self, batch_size, height, width, generator):
        """`[B, C, F', h, w]` drawn as the pipeline draws them (in the model's dtype)."""
        pipe = self.pipeline
        return pipe.prepare_latents(
            batch_size,
            pipe.num_channels_latents,
            height,
            width,
            self.options.num_frames,
            self.dtype,
            self.device,
            generator,
        )

    def schedule(self, num_steps, latent_shape):
        """The pipeline's sigmas `linspace(1, 0, N + 1)[:-1]` through `scheduler.set_timesteps` (its static shift)."""
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

        sigmas = np.linspace(1.0, 0.0, num_steps + 1)[:-1]
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=sigmas)
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def decode(self, latents, height, width):
        """Videos `[B, 3, F, H, W]` in [0, 1] (the pipeline's scaling, VAE decode and post-processing)."""
        pipe = self.pipeline
        latents = latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor
        # one video at a time (the VAE's `enable_slicing`): its mid-block attention mask does not broadcast over a
        # batch of more than one video in diffusers 0.42.1
        video = torch.cat([pipe.vae.decode(z, return_dict=False)[0] for z in latents.split(1)])
        frames = pipe.video_processor.postprocess_video(video, output_type="pt")  # [B, F, 3, H, W]
        return frames.permute(0, 2, 1, 3, 4)

    def default_size(self):
        """The pipeline's default: the 16:9 bucket at `transformer.config.target_size` (480p: 480 x 848)."""
        pipe = self.pipeline
        width, height = pipe.default_aspect_ratio
        return tuple(pipe.video_processor.calculate_default_height_width(height, width, pipe.target_size))

    @staticmethod
    def tiny(seed: int = 0, task_type: str = "t2v"):
        """A `HunyuanVideo15Pipeline` with diffusers' test transformer (1 dual-stream block, 1 refiner block; 4 latent
        channels: `in_channels` 9 = 4 + 4 + 1), a 3-layer Qwen2.5-VL text model, a 2-layer ByT5-sized T5, and a
        4-level `AutoencoderKLHunyuanVideo15` with the real compression (16x spatial, 4x temporal: 64x64, 5 frames
        -> latents 4x2x4x4). The Qwen tokenizer, built in code, spends exactly the pipeline's `crop_start` (108)
        tokens on the template before the prompt, as the real one does, so the crop drops the same text.
        `FlowMatchEulerDiscreteScheduler(shift=7.0)` and `ClassifierFreeGuidance(guidance_scale=1.0)`, as diffusers'
        test; the pipeline's own loop is then the Euler ODE flowrl's `ode` sampler takes. `task_type`: the
        transformer's (`"i2v"` for the image-to-video family's components,
        `flowrl.models.families.hunyuan_video_i2v`)."""
        from diffusers import (
            AutoencoderKLHunyuanVideo15,
            ClassifierFreeGuidance,
            FlowMatchEulerDiscreteScheduler,
            HunyuanVideo15Pipeline,
            HunyuanVideo15Transformer3DModel,
        )
        from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

        tokenizer = tiny_hunyuan_video_tokenizer()
        tokenizer_2 = ByT5Tokenizer()
        text_dim, glyph_dim, latent_channels = 16, 32, 4
        torch.manual_seed(seed)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * latent_channels + 1,
            out_channels=latent_channels,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=1,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            text_embed_dim=text_dim,
            text_embed_2_dim=glyph_dim,
            image_embed_dim=12,
            rope_axes_dim=(2, 2, 4),
            target_size=64,
            task_type=task_type,
        )
        torch.manual_seed(seed + 1)
        text_encoder = Qwen2_5_VLTextModel(
            Qwen2_5_VLTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=text_dim,
                intermediate_size=16,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=None,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            )
        )
        torch.manual_seed(seed + 2)
        text_encoder_2 = _t5_encoder(tokenizer_2, glyph_dim)
        torch.manual_seed(seed + 3)
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=latent_channels,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            spatial_compression_ratio=16,
            temporal_compression_ratio=4,
            downsample_match_channel=False,
            upsample_match_channel=False,
        )
        vae.enable_slicing()  # decode video by video: batched decoding fails in diffusers 0.42.1 (see `decode`)
        return _eval(
            HunyuanVideo15Pipeline(
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                transformer=transformer,
                vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                text_encoder_2=text_encoder_2,
                tokenizer_2=tokenizer_2,
                guider=ClassifierFreeGuidance(guidance_scale=1.0),
            )
        )


def _system_message() -> str:
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def tiny_hunyuan_video_tokenizer():
    """A byte-level BPE `Qwen2Tokenizer` (every string tokenizes) with the Qwen special tokens and a ChatML template,
    built in memory, whose merges keep each word of HunyuanVideo 1.5's system message whole (and its 8-space runs one
    token): the template before the prompt is then exactly 108 tokens, the pipeline's `crop_start`."""
    words = byte_level_words(f"system\n{_system_message()}\nuser\n")  # the template's text around its special tokens
    spaces = [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("ĠĠĠĠ", "ĠĠĠĠ")]  # a run of 8 spaces -> one token
    return tiny_qwen2_tokenizer(merges=whole_word_merges([w for w in words if set(w) != {"Ġ"}], spaces))
