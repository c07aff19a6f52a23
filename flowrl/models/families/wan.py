"""Wan 2.1 / 2.2 text-to-video: the adapter, its options and a tiny offline `WanPipeline`.

Shapes. Images are `[B, 3, H, W]` and videos `[B, 3, F, H, W]` (channels first, then frames), in [0, 1]; Wan's latents
are `[B, 16, F', H/8, W/8]` with `F' = (F - 1) / 4 + 1` latent frames (the VAE compresses time 4x and keeps the first
frame), so `F` must be 1, 5, 9, ... The step kernels and log-probs are element-wise over the latent, so a video is one
more axis of the same `[B, K]` steps.

Wan 2.2 A14B has two experts: `transformer` denoises the high-noise steps (`t >= boundary_ratio *
num_train_timesteps`), `transformer_2` the low-noise ones, each with its own CFG scale (`guidance_scale`,
`guidance_scale_2`), exactly as `WanPipeline.__call__` routes them. One of them trains (`Options.trained_expert`)
and the other runs frozen, or both train as one module (`trained_expert: both`, `WanExperts`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import torch

from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.tiny import _eval, tiny_t5_tokenizer


@dataclasses.dataclass
class WanOptions:
    """Options of Wan 2.1 / 2.2 (`model.options`)."""

    num_frames: int = 81
    """Frames per video F; `F - 1` must be divisible by the VAE's temporal factor (4): 1, 5, 9, ..., 81 (the
    pipeline's default; Flow-Factory trains with 5 and evaluates with 13-21). Latents hold `(F - 1) / 4 + 1` frames."""
    max_sequence_length: int = 512
    """UMT5 text tokens (the pipeline's default 512); embeddings are zero-padded to this length."""
    trained_expert: Literal["high_noise", "low_noise", "both"] = "high_noise"
    """Wan 2.2 (two experts): which one trains, `high_noise` (`transformer`, the steps with `t >= boundary_ratio *
    1000`) or `low_noise` (`transformer_2`), the other running frozen; or `both` (one optimizer over both, a LoRA
    on each). A LoRA of `low_noise` loads into diffusers with `pipe.load_lora_weights(dir,
    load_into_transformer_2=True)`; `both` writes the low-noise expert's beside the other, in `dir/transformer_2`.
    Wan 2.1 has one transformer: `high_noise` only."""
    guidance_scale_2: float | None = None
    """Wan 2.2: the CFG scale of the low-noise expert (None: the run's `guidance_scale`, as the pipeline)."""

    def __post_init__(self):
        if self.num_frames < 1 or (self.num_frames - 1) % 4:
            raise ValueError(
                f"model.options.num_frames must be 1, 5, 9, ... (F - 1 divisible by 4), got {self.num_frames}"
            )


@register_family
class WanAdapter(ModelAdapter):
    """Wan 2.1 / 2.2 text-to-video: `WanTransformer3DModel` (2.2: two experts) on video latents, UMT5, true CFG.

    Latents `[B, C, F', h, w]`; `decode` returns videos `[B, 3, F, H, W]` in [0, 1] (`F = options.num_frames`).
    """

    family = "wan"
    Options = WanOptions
    pipeline_class = "WanPipeline"
    video = True
    real_models = (
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers: 1.3B",
        "Wan-AI/Wan2.1-T2V-14B-Diffusers: 14B",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers: 2 x 14B experts (one or both train)",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers: 5B",
    )
    lora_targets = (
        "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
        "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
        "ffn.net.0.proj", "ffn.net.2",
    )  # fmt: skip
    """Flow-Factory's Wan set (`src/flow_factory/models/wan/wan2_t2v.py`, `default_target_modules`): self- and
    cross-attention projections and the feed-forward layers."""

    def __init__(self, pipeline, *, options=None):
        super().__init__(pipeline, options=options)
        expert = self.options.trained_expert
        if expert != "high_noise" and pipeline.config.boundary_ratio is None:
            raise ValueError(f"model.options.trained_expert={expert!r} needs a Wan 2.2 pipeline (boundary_ratio set)")
        self.experts = None
        if expert == "both":
            self.experts = WanExperts(pipeline.transformer, pipeline.transformer_2, pipeline.config.expand_timesteps)
        frozen = self.frozen_expert
        if self.model is None:
            raise ValueError(f"this WanPipeline has no {self.trained_expert_name} to train")
        if frozen is not None:
            frozen.requires_grad_(False)  # never trained: no graph through it

    # ------------------------------------------------------------------------------------------
    # the experts
    # ------------------------------------------------------------------------------------------

    @property
    def trained_expert_name(self) -> str:
        return "transformer" if self.options.trained_expert == "high_noise" else "transformer_2"

    @property
    def model(self):
        return self.experts if self.experts is not None else getattr(self.pipeline, self.trained_expert_name)

    @property
    def lora_load_kwargs(self) -> dict:
        """What `pipe.load_lora_weights` needs for this LoRA (the low-noise expert's: `load_into_transformer_2`)."""
        return {"load_into_transformer_2": True} if self.trained_expert_name == "transformer_2" else {}

    @property
    def frozen_expert(self) -> torch.nn.Module | None:
        """The Wan 2.2 expert that does not train (None for Wan 2.1, or when both train)."""
        if self.boundary_timestep is None or self.experts is not None:
            return None
        other = "transformer_2" if self.trained_expert_name == "transformer" else "transformer"
        return getattr(self.pipeline, other)

    @property
    def boundary_timestep(self) -> float | None:
        """`boundary_ratio * num_train_timesteps` (Wan 2.2), or None (one transformer)."""
        ratio = self.pipeline.config.boundary_ratio
        return None if ratio is None else ratio * self.scheduler.config.num_train_timesteps

    def high_noise(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """`[N]` bool: the rows that `transformer` denoises (`t >= boundary`, the pipeline's test); None for 2.1."""
        boundary = self.boundary_timestep
        return None if boundary is None else self.timesteps_on_host(timesteps) >= boundary  # host data

    def step_guidance(self, guidance_scale: float, timesteps: torch.Tensor):
        """Wan 2.2's CFG scale per row: `guidance_scale` on high-noise steps, `guidance_scale_2` on low-noise ones (a
        float when every row agrees, else `[N, 1, 1, 1, 1]` fp32)."""
        high = self.high_noise(timesteps)
        low_scale = self.options.guidance_scale_2
        if high is None or low_scale is None or bool(high.all()):
            return guidance_scale
        if not bool(high.any()):
            return low_scale
        scales = torch.where(high, float(guidance_scale), float(low_scale)).to(torch.float32)
        return scales.view(-1, 1, 1, 1, 1)

    # ------------------------------------------------------------------------------------------
    # the adapter
    # ------------------------------------------------------------------------------------------

    def encode(self, prompts):
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.options.max_sequence_length,
            device=self.device,
        )
        return {"prompt_embeds": embeds.to(self.dtype)}  # [P, L, D], zero-padded to L: batch-independent

    def _call(self, net, latents, timesteps, cond):
        return _expert_call(net, latents, timesteps, cond, self.pipeline.config.expand_timesteps)

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        """The velocity `[N, C, F', h, w]`; Wan 2.2 routes each row to its expert by its timestep (the trained expert
        is `model`, the frozen one the pipeline's). Rows of both kinds in one chunk run through both experts at the
        chunk's full size and are selected row-wise, so each call keeps the shapes it has at rollout."""
        trained = model or self.model
        high = self.high_noise(timesteps)
        if self.experts is not None:  # both train: the module routes (so a DDP/FSDP wrapper sees one call)
            return trained(latents, timesteps, cond, high)
        if high is None:
            return self._call(trained, latents, timesteps, cond)
        frozen = self.frozen_expert
        high_net, low_net = (trained, frozen) if self.trained_expert_name == "transformer" else (frozen, trained)
        if bool(high.all()):
            return self._call(high_net, latents, timesteps, cond)
        if not bool(high.any()):
            return self._call(low_net, latents, timesteps, cond)
        both = self._call(high_net, latents, timesteps, cond), self._call(low_net, latents, timesteps, cond)
        return torch.where(high.view(-1, 1, 1, 1, 1).to(latents.device, non_blocking=True), *both)

    def initial_latents(self, batch_size, height, width, generator):
        """`[B, C, F', h, w]` drawn in fp32 as the pipeline draws them, then in the model's dtype."""
        channels = self.model.config.in_channels
        latents = self.pipeline.prepare_latents(
            batch_size, channels, height, width, self.options.num_frames, torch.float32, self.device, generator
        )
        return latents.to(self.dtype)

    def schedule(self, num_steps, latent_shape):
        """The pipeline's `scheduler.set_timesteps(num_steps)` (flow-matching Euler, or UniPC with flow sigmas)."""
        self.scheduler.set_timesteps(num_steps, device="cpu")
        return self.scheduler.timesteps, self.scheduler.sigmas.to(torch.float32)

    def decode(self, latents, height, width):
        """Videos `[B, 3, F, H, W]` in [0, 1] (the pipeline's de-normalisation, VAE decode and post-processing)."""
        vae = self.pipeline.vae
        z = vae.config.z_dim
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        frames = self.pipeline.video_processor.postprocess_video(video, output_type="pt")  # [B, F, 3, H, W]
        return frames.permute(0, 2, 1, 3, 4)

    def default_size(self):
        """480x832, the pipeline's default (Wan 2.1 480p)."""
        return 480, 832

    @classmethod
    def load_lora_into(cls, pipeline, directory) -> None:
        """`pipe.load_lora_weights(dir)`, and the low-noise expert's LoRA from `dir/transformer_2` when both
        experts trained (with `load_into_transformer_2=True`)."""
        super().load_lora_into(pipeline, directory)
        if (Path(directory) / LOW_NOISE / LORA_FILE).is_file():
            pipeline.load_lora_weights(str(Path(directory) / LOW_NOISE), load_into_transformer_2=True)

    @classmethod
    def lora_load_line(cls, directory, extra: str = "") -> str:
        line = super().lora_load_line(directory, extra)
        if (Path(directory) / LOW_NOISE / LORA_FILE).is_file():
            line += f"; pipe.load_lora_weights({str(Path(directory) / LOW_NOISE)!r}, load_into_transformer_2=True)"
        return line

    @staticmethod
    def tiny(seed: int = 0, two_experts: bool = False):
        """A `WanPipeline` with a 2-layer `WanTransformer3DModel` (diffusers' test sizes), a tiny UMT5 and a 3-level
        `AutoencoderKLWan` (spatial 8x, temporal 4x: 64x64, 5 frames -> latents 16x2x8x8).

        `two_experts=True` builds Wan 2.2 A14B's layout: a second transformer (`transformer_2`, the low-noise
        expert) and `boundary_ratio=0.875`. Both use `FlowMatchEulerDiscreteScheduler(shift=7.0)` (diffusers'
        Wan 2.1 test), so the pipeline's own loop is the Euler ODE flowrl's `ode` sampler takes.
        """
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        tokenizer = tiny_t5_tokenizer()

        def transformer():
            return WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=2,
                attention_head_dim=12,
                in_channels=16,
                out_channels=16,
                text_dim=32,
                freq_dim=256,
                ffn_dim=32,
                num_layers=2,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                rope_max_seq_len=32,
            )

        torch.manual_seed(seed)
        high = transformer()
        torch.manual_seed(seed + 1)
        low = transformer() if two_experts else None
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
        return _eval(
            WanPipeline(
                tokenizer=tokenizer,
                text_encoder=text_encoder,
                vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
                transformer=high,
                transformer_2=low,
                boundary_ratio=0.875 if two_experts else None,
            )
        )


LOW_NOISE = "transformer_2"
"""The subfolder of a LoRA export holding the low-noise expert's LoRA when both experts trained."""
LORA_FILE = "pytorch_lora_weights.safetensors"


def _expert_call(net, latents, timesteps, cond, expand_timesteps: bool) -> torch.Tensor:
    """One expert's velocity `[N, C, F', h, w]` (Wan 2.2 TI2V, `expand_timesteps`: a timestep per latent token).

    Image-to-video (`cond["condition"]`, `flowrl.models.families.wan_i2v`): Wan 2.1 / 2.2 A14B see the latents
    concatenated on channels with the start frame's mask and latents (and Wan 2.1 its CLIP embeddings,
    `cond["image_embeds"]`); TI2V-5B's state holds the start frame's latent as its first frame, whose tokens see
    timestep 0, as `WanImageToVideoPipeline.__call__` builds them."""
    t, hidden = timesteps, latents
    if "condition" in cond and not expand_timesteps:
        hidden = torch.cat([latents, cond["condition"].to(latents.dtype)], dim=1)
    if expand_timesteps:  # all equal for text-to-video; 0 on the start frame's tokens for image-to-video
        p = net.config.patch_size
        f, h, w = latents.shape[2] // p[0], latents.shape[3] // p[1], latents.shape[4] // p[2]
        t = timesteps[:, None].expand(-1, f * h * w)
        if "condition" in cond:  # the pipeline's `(first_frame_mask[0][0][:, ::2, ::2] * t).flatten()`
            mask = torch.ones(f, h, w, dtype=torch.float32, device=latents.device)
            mask[0] = 0
            t = mask.flatten()[None] * timesteps[:, None]
    image = cond.get("image_embeds")
    out = net(
        hidden_states=hidden,
        timestep=t,
        encoder_hidden_states=cond["prompt_embeds"],
        encoder_hidden_states_image=image,
        return_dict=False,
    )
    return out[0]


class WanExperts(torch.nn.Module):
    """Wan 2.2's two experts as the one trained module (`trained_expert: both`): `transformer` (high noise) and
    `transformer_2` (low noise), the pipeline's own modules. `forward` routes each row by its step as the pipeline
    does (a chunk with rows of both kinds runs both experts at its full size and selects row-wise), so the
    optimizer, EMA, checkpoints, DDP and FSDP2 (each expert's blocks) see one module. The LoRA and gradient-
    checkpointing calls flowrl makes on a diffusers model go to both experts."""

    def __init__(self, transformer, transformer_2, expand_timesteps: bool = False):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.expand_timesteps = bool(expand_timesteps)

    def forward(self, latents, timesteps, cond, high: torch.Tensor) -> torch.Tensor:
        def call(net):
            return _expert_call(net, latents, timesteps, cond, self.expand_timesteps)

        if bool(high.all()):
            return call(self.transformer)
        if not bool(high.any()):
            return call(self.transformer_2)
        return torch.where(
            high.view(-1, 1, 1, 1, 1).to(latents.device, non_blocking=True),
            call(self.transformer),
            call(self.transformer_2),
        )

    def experts(self) -> list[tuple[str, torch.nn.Module]]:
        """`(subfolder of a LoRA export, expert)`: the high-noise expert's LoRA at the top, the other's in
        `transformer_2/` (`load_into_transformer_2=True`)."""
        return [("", self.transformer), (LOW_NOISE, self.transformer_2)]

    # what flowrl calls on a diffusers model, for both experts
    @property
    def config(self):
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def peft_config(self):
        return self.transformer.peft_config  # AttributeError without an adapter, as a diffusers model

    def add_adapter(self, config) -> None:
        for _, expert in self.experts():
            expert.add_adapter(config)

    def delete_adapters(self, name) -> None:
        for _, expert in self.experts():
            expert.delete_adapters(name)

    def disable_adapters(self) -> None:
        for _, expert in self.experts():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for _, expert in self.experts():
            expert.enable_adapters()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return all(expert.is_gradient_checkpointing for _, expert in self.experts())

    def enable_gradient_checkpointing(self) -> None:
        for _, expert in self.experts():
            expert.enable_gradient_checkpointing()

    def set_attention_backend(self, backend: str) -> None:
        for _, expert in self.experts():
            expert.set_attention_backend(backend)
