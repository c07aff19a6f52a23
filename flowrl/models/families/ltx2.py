"""LTX-2 text-to-video (with audio): the adapter, its options and a tiny offline `LTX2Pipeline` (whose components the
image-to-video family's tiny pipeline shares).

LTX-2 generates audio with the video: one transformer denoises video tokens and audio tokens together (each stream
attends to the other), with its own velocity for each. flowrl trains the video branch and keeps the audio path exact
and untouched:

- the state is both streams' packed latents in one flat tensor per sample, `[B, S_v C_v + S_a C_a]` (the video's
  `[S_v, C_v]` tokens, then the audio's `[S_a, C_a]`), stepped on the pipeline's one schedule;
- the audio elements follow the ODE on every step, as the pipeline's Euler audio scheduler does (`ode_elements`):
  no noise, no log-probability, so the policy's action and its ratio are the video's alone;
- the default LoRA targets are the video branch's layers (self- and text cross-attention, audio-to-video
  attention, feed-forward); the audio layers, the connectors and the audio VAE / vocoder are not trained (the audio
  still changes with training, since it attends to the video);
- `decode` returns the video; the audio latents are denoised exactly as the pipeline denoises them but not decoded
  (no reward reads them).

Guidance is classifier-free on both streams at the run's `guidance_scale` (the pipeline's delta form in x0 space,
`x0_c + (s - 1)(x0_c - x0_u)`, is the same combination of velocities); the pipeline's spatio-temporal guidance and
modality-isolation guidance (extra network calls) and its guidance rescale are off, as in Flow-Factory's LTX-2
training (`stg_scale 0`, `modality_scale 1`, `guidance_rescale 0`; `pipeline_call_kwargs` passes these to diffusers).

Image-to-video is the `ltx2_i2v` family (`flowrl.models.families.ltx2_i2v`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.tiny import _eval, tiny_gemma_tokenizer


@dataclasses.dataclass
class LTX2Options:
    """Options of LTX-2 (`model.options`)."""

    num_frames: int = 121
    """Frames per video F; `F - 1` must be divisible by the VAE's temporal factor (8 for LTX-2: 1, 9, ..., 121, the
    pipeline's default for checkpoints without a duration head)."""
    frame_rate: float = 24.0
    """Frames per second: the audio's length (`F / frame_rate` seconds) and the video's positional embeddings."""
    max_sequence_length: int = 1024
    """Gemma 3 text tokens (the pipeline's default 1024), left-padded to this length with a mask."""
    cross_timestep: bool = True
    """The pipeline's `use_cross_timestep` (True, its default): each stream's cross-modal attention is modulated by
    the other stream's timestep."""

    def __post_init__(self):
        if self.num_frames < 1 or self.frame_rate <= 0 or self.max_sequence_length < 1:
            raise ValueError(
                f"model.options: num_frames ({self.num_frames}), frame_rate ({self.frame_rate}) and "
                f"max_sequence_length ({self.max_sequence_length}) must be positive"
            )


@register_family
class LTX2Adapter(ModelAdapter):
    """LTX-2 text-to-video (with audio): `LTX2VideoTransformer3DModel`, Gemma 3 text through LTX-2's connectors, CFG.

    The video branch trains; the audio latents are denoised with it on the ODE, untouched (module docstring).
    """

    family = "ltx2"
    Options = LTX2Options
    pipeline_class = "LTX2Pipeline"
    video = True
    real_models = ("Lightricks/LTX-2: 19B (audio-video transformer; the video branch trains)",)
    lora_targets = (
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
        "audio_to_video_attn.to_q",
        "audio_to_video_attn.to_k",
        "audio_to_video_attn.to_v",
        "audio_to_video_attn.to_out.0",
        "ff.net.0.proj",
        "ff.net.2",
    )
    """The video branch of Flow-Factory's LTX-2 set (`src/flow_factory/models/ltx2/ltx2_t2av.py`,
    `default_target_modules`: 28 layers per block over both streams): video self- and text cross-attention, the
    audio-to-video attention (its output joins the video stream) and the video feed-forward; no audio layer."""

    def __init__(self, pipeline, *, options=None):
        super().__init__(pipeline, options=options)
        ratio = pipeline.vae_temporal_compression_ratio
        if (self.options.num_frames - 1) % ratio:
            raise ValueError(
                f"model.options.num_frames must be 1 plus a multiple of the VAE's temporal factor "
                f"({ratio}), got {self.options.num_frames}"
            )
        length, registers = self.options.max_sequence_length, self._registers()
        if registers and length % registers:
            raise ValueError(f"model.options.max_sequence_length ({length}) must be a multiple of {registers}")

    def _registers(self) -> int | None:
        """The connectors' learnable registers (128 in LTX-2; both streams): they replace the text's padding."""
        streams = (self.pipeline.connectors.video_connector, self.pipeline.connectors.audio_connector)
        return streams[0].num_learnable_registers if all(c.learnable_registers is not None for c in streams) else None

    @property
    def model(self):
        return self.pipeline.transformer

    # ----- sizes -----

    def _audio_shape(self) -> tuple[int, int, int]:
        """`(channels, latent length, latent mel bins)` of the audio latents, as the pipeline computes them."""
        pipe = self.pipeline
        per_second = (
            pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        )
        length = round(self.options.num_frames / self.options.frame_rate * per_second)
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return pipe.audio_vae.config.latent_channels, length, mel

    def _video_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """`(latent frames, latent height, latent width)` of an `height` x `width` video."""
        pipe = self.pipeline
        frames = (self.options.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        return frames, height // pipe.vae_spatial_compression_ratio, width // pipe.vae_spatial_compression_ratio

    @property
    def audio_size(self) -> int:
        """Elements of one sample's packed audio latents (the tail of the state)."""
        channels, length, mel = self._audio_shape()
        return channels * length * mel

    def static_inputs(self, height, width):
        """The latent grid `[F', h, w]` of the rollout's size (the network's `num_frames`, `height`, `width`)."""
        return {"grid": torch.tensor(self._video_grid(height, width))}

    def _split(self, latents, static):
        """Video tokens `[N, S_v, C]` and audio tokens `[N, S_a, C_a]` of flat states `latents [N, D]`."""
        channels, length, mel = self._audio_shape()
        video = latents[:, : latents.shape[1] - self.audio_size]
        return video.reshape(len(latents), -1, self.model.config.in_channels), latents[:, video.shape[1] :].reshape(
            len(latents), length, channels * mel
        )

    # ----- conditioning -----

    def encode(self, prompts):
        """Gemma 3's stacked hidden states through the pipeline's connectors: video and audio text embeddings `[P, L,
        D]` and the mask `[P, L]` (left-padded to `max_sequence_length`: a prompt's rows never depend on its batch)."""
        pipe = self.pipeline
        embeds, mask, _, _ = pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=False,
            max_sequence_length=self.options.max_sequence_length,
            device=self.device,
        )
        side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=side)
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": mask}

    # ----- the network -----

    def _video_timestep(self, timesteps, video_tokens: int):
        """The video stream's timestep (text-to-video: one per row)."""
        return timesteps

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        """The velocity `[N, D]` of both streams (fp32, as the pipeline casts it), from one network call."""
        frames, height, width = (int(v) for v in static["grid"])
        video, audio = self._split(latents, static)
        # with registers the pipeline's mask adds zeros: none is the same attention, and lets flash kernels run
        mask = None if self._registers() else cond["prompt_attention_mask"]
        t = timesteps.to(latents.dtype)
        video_v, audio_v = (model or self.model)(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=cond["prompt_embeds"],
            audio_encoder_hidden_states=cond["audio_prompt_embeds"],
            timestep=self._video_timestep(t, video.shape[1]),
            audio_timestep=t,
            sigma=t,  # as the pipeline passes it (LTX-2.3 reads it)
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=frames,
            height=height,
            width=width,
            fps=self.options.frame_rate,
            audio_num_frames=audio.shape[1],
            use_cross_timestep=self.options.cross_timestep,
            return_dict=False,
        )
        return torch.cat([self._video_velocity(video_v.float()).flatten(1), audio_v.float().flatten(1)], dim=1)

    def _video_velocity(self, velocity):
        return velocity

    def ode_elements(self, latents):
        """The audio latents (the state's last `audio_size` elements): the pipeline's ODE, never sampled or scored."""
        if latents.ndim != 2 or latents.shape[1] <= self.audio_size:
            return None
        fixed = torch.zeros(latents.shape[1], dtype=torch.bool)  # host data: from the shape
        fixed[latents.shape[1] - self.audio_size :] = True
        return fixed

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, batch_size: int, negative_prompt: str = "") -> dict:
        """flowrl's guidance in diffusers: CFG at `guidance_scale` on both streams, no spatio-temporal or
        modality-isolation guidance and no rescale (the pipeline's defaults turn them on)."""
        return {
            "guidance_scale": guidance_scale,
            "audio_guidance_scale": guidance_scale,
            "stg_scale": 0.0,
            "audio_stg_scale": 0.0,
            "modality_scale": 1.0,
            "audio_modality_scale": 1.0,
            "guidance_rescale": 0.0,
            "audio_guidance_rescale": 0.0,
            "negative_prompt": [negative_prompt] * batch_size,
        }

    # ----- the state -----

    def initial_latents(self, batch_size, height, width, generator):
        """The video noise then the audio noise, drawn in fp32 as the pipeline draws them (`prepare_latents`,
        `prepare_audio_latents`), packed and flattened into one `[B, D]` state."""
        pipe = self.pipeline
        shape = (batch_size, self.model.config.in_channels, *self._video_grid(height, width))
        video = randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)
        video = pipe._pack_latents(video, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        channels, length, mel = self._audio_shape()
        audio = randn_tensor(
            (batch_size, channels, length, mel), generator=generator, device=self.device, dtype=torch.float32
        )
        audio = pipe._pack_audio_latents(audio)
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1).to(self.dtype)

    def schedule(self, num_steps, latent_shape):
        """The pipeline's sigmas `linspace(1, 1/N, N)` with the shift `mu` of the video's token count."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

        tokens = (latent_shape[1] - self.audio_size) // self.model.config.in_channels
        config = self.scheduler.config
        mu = calculate_shift(
            tokens,
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def shift_mu(self, latent_shape):
        if not self.scheduler.config.get("use_dynamic_shifting", False):
            return None
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        config = self.scheduler.config
        tokens = (latent_shape[1] - self.audio_size) // self.model.config.in_channels
        return calculate_shift(
            tokens,
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )

    def decode(self, latents, height, width):
        """Videos `[B, 3, F, H, W]` in [0, 1]: the video tokens unpacked, de-normalised and decoded as the pipeline
        does (decode timestep 0, no decode noise); the audio is not decoded."""
        pipe = self.pipeline
        frames, h, w = self._video_grid(height, width)
        video, _ = self._split(latents, None)
        p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        video = pipe._unpack_latents(video, frames, h, w, p, pt)
        video = pipe._denormalize_latents(
            video, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor
        ).to(pipe.vae.dtype)
        timestep = None
        if pipe.vae.config.timestep_conditioning:  # decode_timestep 0.0: the latents unchanged, timestep 0
            timestep = torch.zeros(len(video), device=video.device, dtype=video.dtype)
        out = pipe.vae.decode(video, timestep, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(out, output_type="pt").permute(0, 2, 1, 3, 4)

    def default_size(self):
        """512 x 768, the pipeline's default."""
        return 512, 768

    @classmethod
    def tiny(cls, seed: int = 0):
        """The family's pipeline at toy sizes (`tiny_ltx2_components`: 64x64, 5 frames -> 2 x 8 x 8 video tokens of 4
        channels and 5 audio tokens of 4)."""
        import diffusers

        return _eval(getattr(diffusers, cls.pipeline_class)(**tiny_ltx2_components(seed)))


def tiny_ltx2_components(seed: int = 0) -> dict:
    """LTX-2's components at toy sizes: a 2-layer Gemma 3 (with a 1-layer SigLIP tower, as the class has), the text
    connectors (1 layer per stream), a 2-layer audio-video transformer (diffusers' test sizes), a 2-block video VAE
    with 8x spatial and 4x temporal compression (64x64, 5 frames -> 4 x 2 x 8 x 8), an audio VAE (2 latent channels,
    8 mel bins) and a vocoder. `FlowMatchEulerDiscreteScheduler()`, as diffusers' test."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    tokenizer, hidden = tiny_gemma_tokenizer(), 32
    torch.manual_seed(seed)
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=Gemma3TextConfig(
                vocab_size=len(tokenizer),
                hidden_size=hidden,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                max_position_embeddings=256,
                pad_token_id=0,
                eos_token_id=1,
                bos_token_id=2,
                sliding_window=64,
            ),
            vision_config=SiglipVisionConfig(
                hidden_size=16,
                intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
            image_token_index=len(tokenizer),
            boi_token_index=2,
            eoi_token_index=1,
        )
    )
    torch.manual_seed(seed + 1)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        qk_norm="rms_norm_across_heads",
        caption_channels=hidden,
        rope_double_precision=False,
        rope_type="split",
    )
    torch.manual_seed(seed + 2)
    connectors = LTX2TextConnectors(
        caption_channels=hidden,
        text_proj_in_factor=3,
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=32,
        rope_theta=10000.0,
        rope_double_precision=False,
        causal_temporal_positioning=False,
        rope_type="split",
    )
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLLTX2Video(
        latent_channels=4,
        block_out_channels=(8, 8),
        down_block_types=("LTX2VideoDownBlock3D",) * 2,
        decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False,) * 3,
        downsample_type=("spatiotemporal",) * 2,
        upsample_type=("spatiotemporal",) * 2,
        upsample_residual=(False,) * 2,
        upsample_factor=(1, 1),
        patch_size=2,
        patch_size_t=1,
        timestep_conditioning=False,
        decoder_causal=False,
    )
    torch.manual_seed(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    torch.manual_seed(seed + 5)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    )
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": vae,
        "audio_vae": audio_vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "connectors": connectors,
        "transformer": transformer,
        "vocoder": vocoder,
    }
