"""Kandinsky 5.0 text-to-video (`kandinsky5`) and text-to-image (`kandinsky5_image`): the adapters, their options and
tiny offline `Kandinsky5T2VPipeline` / `Kandinsky5T2IPipeline`.

Latents are channels-last, as the pipelines keep them: videos `[B, F', h, w, C]`, images `[B, 1, h, w, C]`. Text is
Qwen2.5-VL's last hidden state over the prompt in the pipeline's template (its first `prompt_template_encode_start_idx`
tokens dropped) plus CLIP's pooled embedding. The transformer takes no text mask: the pipelines pad a batch's
prompts to the longest one, so a prompt's conditioning depends on the prompts batched with it (diffusers' own tests
allow 5e-3 between a batch and its samples alone). flowrl encodes each prompt alone, keeps its own tokens (stored
zero-padded with its length) and runs the network on the rows of each text length apart, so a sample never depends on
its batch and re-scores exactly; its output equals the pipeline's for one prompt per call (or prompts of one length).

CFG is `uncond + s (text - uncond)` against the policy's negative prompt (the text-to-video pipeline's default
negative prompt, used when none is given, is a long string: pass `negative_prompt` to compare; flowrl's default is
the empty prompt). The text-to-image pipeline snaps the size to its resolution list; flowrl keeps the run's size.
"""

from __future__ import annotations

import codecs
import dataclasses
import inspect
import re

import torch

from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.helpers import load_component, pad_rows, per_text_length, processor_without_video
from flowrl.models.tiny import (
    _clip_text_encoder,
    _eval,
    byte_level_words,
    tiny_clip_tokenizer,
    tiny_qwen2_tokenizer,
    whole_word_merges,
)


@dataclasses.dataclass
class Kandinsky5ImageOptions:
    """Options of Kandinsky 5.0 text-to-image (`model.options`)."""

    max_sequence_length: int = 512
    """Qwen2.5-VL prompt tokens kept after the template (the pipelines' default 512); a prompt keeps its own tokens."""

    def __post_init__(self):
        if self.max_sequence_length < 1:
            raise ValueError(f"model.options.max_sequence_length must be >= 1, got {self.max_sequence_length}")


@dataclasses.dataclass
class Kandinsky5Options(Kandinsky5ImageOptions):
    """Options of Kandinsky 5.0 text-to-video (`model.options`)."""

    num_frames: int = 121
    """Frames per video F; `F - 1` divisible by the VAE's temporal factor (4): 1, 5, ..., 121 (the pipeline's
    default, 5 s at 24 fps)."""

    def __post_init__(self):
        super().__post_init__()
        if self.num_frames < 1 or (self.num_frames - 1) % 4:
            raise ValueError(
                f"model.options.num_frames must be 1, 5, 9, ... (F - 1 divisible by 4), got {self.num_frames}"
            )


@register_family
class Kandinsky5Adapter(ModelAdapter):
    """Kandinsky 5.0 text-to-video: `Kandinsky5Transformer3DModel` on channels-last video latents, Qwen2.5-VL + CLIP.

    Each prompt keeps its own text tokens (no padding to its batch's longest); rows of one text length share a call.
    """

    family = "kandinsky5"
    Options = Kandinsky5Options
    pipeline_class = "Kandinsky5T2VPipeline"
    video = True
    real_models = (
        "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers: 2B",
        "kandinskylab/Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers: 19B",
    )
    lora_targets = (
        "self_attention.to_query",
        "self_attention.to_key",
        "self_attention.to_value",
        "self_attention.out_layer",
        "cross_attention.to_query",
        "cross_attention.to_key",
        "cross_attention.to_value",
        "cross_attention.out_layer",
        "feed_forward.in_layer",
        "feed_forward.out_layer",
    )
    """No peer publishes a Kandinsky 5 LoRA set: the attention (self and text cross-attention) and feed-forward
    projections of every block, as the Wan set (Flow-Factory) covers Wan's; the suffixes also match the 2 text
    blocks' self-attention and feed-forward."""
    pipeline_pads_prompts = True
    """The pipeline pads a batch's prompts to the longest without a mask: its batched output depends on the batch, so
    the family's parity tests call it one prompt at a time."""

    @property
    def model(self):
        return self.pipeline.transformer

    @classmethod
    def pipeline_load_kwargs(cls, name_or_path: str) -> dict:
        """The Qwen2-VL processor (the `tokenizer` slot), loaded without the video processor that needs torchvision."""
        return {"tokenizer": load_component(processor_without_video("Qwen2VLProcessor"), name_or_path, "tokenizer")}

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, batch_size: int, negative_prompt: str = "") -> dict:
        """`guidance_scale` and the negative prompt per sample (the pipeline's default negative prompt is long)."""
        return {"guidance_scale": guidance_scale, "negative_prompt": [negative_prompt] * batch_size}

    # ----- conditioning -----

    def encode(self, prompts):
        """Each prompt alone through `encode_prompt`: Qwen embeddings zero-padded to `max_sequence_length` `[P, L, D]`,
        each prompt's token count `prompt_lengths [P]` and CLIP's pooled embedding `[P, D2]`."""
        length = self.options.max_sequence_length
        rows = []
        for prompt in prompts:
            qwen, clip, _ = self.pipeline.encode_prompt(
                prompt=[prompt], max_sequence_length=length, device=self.device, dtype=self.dtype
            )
            rows.append((qwen[0], clip[0]))
        texts = [qwen for qwen, _ in rows]
        embeds, lengths = pad_rows(texts, max(length, max(len(q) for q in texts)))  # lengths: host data
        return {"prompt_embeds": embeds, "prompt_lengths": lengths, "pooled": torch.stack([c for _, c in rows])}

    # ----- the network -----

    def _scale_factor(self, height: int, width: int):
        return self.pipeline._get_scale_factor(height, width)

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        """The velocity `[N, F', h, w, C]`: one network call per text length among the rows (each with the text
        rotary positions of its length), as the pipeline's call for prompts of that length."""
        model, pipe = model or self.model, self.pipeline
        frames, h, w = latents.shape[1:4]
        scale = pipe.vae_scale_factor_spatial
        visual_rope = [torch.arange(n, device=latents.device) for n in (frames, h // 2, w // 2)]
        scale_factor = self._scale_factor(h * scale, w * scale)
        sparse = self._sparse(latents)
        channels = latents.shape[-1]

        def predict(rows, length):
            pred = model(
                hidden_states=latents[rows],
                encoder_hidden_states=cond["prompt_embeds"][rows, :length].to(latents.dtype),
                pooled_projections=cond["pooled"][rows].to(latents.dtype),
                timestep=timesteps[rows.to(timesteps.device)].to(latents.dtype),
                visual_rope_pos=visual_rope,
                text_rope_pos=torch.arange(length, device=latents.device),
                scale_factor=scale_factor,
                sparse_params=sparse,
                return_dict=True,
            ).sample
            if pred.shape[-1] < channels:  # visual conditioning channels: velocity 0 (they stay zeros and mask)
                pred = torch.cat([pred, pred.new_zeros(*pred.shape[:-1], channels - pred.shape[-1])], dim=-1)
            return pred

        return per_text_length(latents, cond["prompt_lengths"].tolist(), predict)

    def ode_elements(self, latents):
        """A `visual_cond` transformer's state carries the (zero) conditioning latents and mask after the latents, as
        the pipeline keeps them (it steps only the first `out_visual_dim` channels): they follow the ODE, with velocity
        0. None for a plain transformer."""
        channels = self.model.config.out_visual_dim
        if latents.ndim != 5 or latents.shape[-1] <= channels:
            return None
        fixed = torch.zeros(latents.shape[1:], dtype=torch.bool)  # host data: from the shape
        fixed[..., channels:] = True
        return fixed

    def _sparse(self, latents):
        return self.pipeline.get_sparse_params(latents, latents.device)

    # ----- the state -----

    def initial_latents(self, batch_size, height, width, generator):
        """`[B, F', h, w, C]` drawn as the pipeline's `prepare_latents` draws them (in the transformer's dtype)."""
        pipe = self.pipeline
        return pipe.prepare_latents(
            batch_size,
            self.model.config.in_visual_dim,
            height,
            width,
            self.options.num_frames,
            self.dtype,
            self.device,
            generator,
        )

    def schedule(self, num_steps, latent_shape):
        """The pipeline's `scheduler.set_timesteps(num_steps)` (flow-matching Euler with its shift)."""
        self.scheduler.set_timesteps(num_steps, device="cpu")
        return self.scheduler.timesteps, self.scheduler.sigmas.to(torch.float32)

    def decode(self, latents, height, width):
        """Videos `[B, 3, F, H, W]` in [0, 1] (the pipeline's scaling, VAE decode and post-processing)."""
        vae, channels = self.pipeline.vae, self.model.config.out_visual_dim
        video = latents[..., :channels].to(vae.dtype).permute(0, 4, 1, 2, 3) / vae.config.scaling_factor
        video = vae.decode(video).sample
        frames = self.pipeline.video_processor.postprocess_video(video, output_type="pt")  # [B, F, 3, H, W]
        return frames.permute(0, 2, 1, 3, 4)

    def default_size(self):
        """512 x 768, the pipeline's default."""
        return 512, 768

    @staticmethod
    def tiny(seed: int = 0):
        """A `Kandinsky5T2VPipeline` at diffusers' test sizes: a 1+1-block transformer (4 latent channels), a 2-layer
        Qwen2.5-VL (with its 1-block vision tower) behind a processor built in code, a 2-layer CLIP text model and a
        4-level `AutoencoderKLHunyuanVideo` (8x spatial, 4x temporal: 64x64, 5 frames -> latents 2 x 8 x 8 x 4, then
        the zero visual-conditioning channels and mask of a `visual_cond` transformer, as released T2V checkpoints);
        `FlowMatchEulerDiscreteScheduler(shift=7.0)`."""
        from diffusers import AutoencoderKLHunyuanVideo, Kandinsky5T2VPipeline

        torch.manual_seed(seed + 3)
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
            latent_channels=4,
            block_out_channels=(8,) * 4,
            layers_per_block=1,
            norm_num_groups=4,
        )
        return _eval(Kandinsky5T2VPipeline(vae=vae, **_tiny_parts(seed, latent_channels=4, visual_cond=True)))


@register_family
class Kandinsky5ImageAdapter(Kandinsky5Adapter):
    """Kandinsky 5.0 text-to-image: the video family's network on one latent frame, a FLUX.1 VAE, CFG."""

    family = "kandinsky5_image"
    Options = Kandinsky5ImageOptions
    pipeline_class = "Kandinsky5T2IPipeline"
    video = False
    pipeline_output = "image"
    real_models = ("kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers: 6B",)

    def _scale_factor(self, height, width):
        return [1.0, 1.0, 1.0]

    def _sparse(self, latents):
        return None

    def initial_latents(self, batch_size, height, width, generator):
        """`[B, 1, h, w, C]` drawn as the pipeline draws them."""
        return self.pipeline.prepare_latents(
            batch_size=batch_size,
            num_channels_latents=self.model.config.in_visual_dim,
            height=height,
            width=width,
            dtype=self.dtype,
            device=self.device,
            generator=generator,
        )

    def decode(self, latents, height, width):
        """Images `[B, 3, H, W]` in [0, 1] (the pipeline's scaling and decode: no shift, as it does)."""
        vae, channels = self.pipeline.vae, self.model.config.out_visual_dim
        image = latents[:, 0, ..., :channels].to(vae.dtype).permute(0, 3, 1, 2) / vae.config.scaling_factor
        image = vae.decode(image).sample
        return self.pipeline.image_processor.postprocess(image, output_type="pt")

    def default_size(self):
        """1024 x 1024, the pipeline's default."""
        return 1024, 1024

    @classmethod
    def set_pipeline_size(cls, pipeline, height, width):
        """Add `width x height` to the pipeline's `resolutions` (its training sizes; it snaps others to them)."""
        if (width, height) not in pipeline.resolutions:
            pipeline.resolutions = [*pipeline.resolutions, (width, height)]

    @staticmethod
    def tiny(seed: int = 0):
        """A `Kandinsky5T2IPipeline` over the tiny parts (16 latent channels) and a 4-level FLUX-style `AutoencoderKL`
        (8x, as the pipeline assumes: 64x64 -> 8 x 8 x 16), with 64 x 64 among its resolutions (the pipeline snaps
        other sizes to its list)."""
        from diffusers import AutoencoderKL, Kandinsky5T2IPipeline

        torch.manual_seed(seed + 3)
        vae = AutoencoderKL(
            act_fn="silu",
            block_out_channels=[16] * 4,
            down_block_types=["DownEncoderBlock2D"] * 4,
            force_upcast=True,
            in_channels=3,
            latent_channels=16,
            layers_per_block=1,
            mid_block_add_attention=False,
            norm_num_groups=8,
            out_channels=3,
            sample_size=128,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            up_block_types=["UpDecoderBlock2D"] * 4,
            use_post_quant_conv=False,
            use_quant_conv=False,
        )
        pipe = Kandinsky5T2IPipeline(vae=vae, **_tiny_parts(seed, latent_channels=16))
        Kandinsky5ImageAdapter.set_pipeline_size(pipe, 64, 64)
        return _eval(pipe)


def _tiny_parts(seed: int, latent_channels: int, visual_cond: bool = False) -> dict:
    """The text encoders, processor and transformer of the tiny Kandinsky 5 pipelines (diffusers' test sizes; the
    transformer's zero-initialised modulations drawn at random, else its blocks would not act)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5Transformer3DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer = tiny_kandinsky5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "vocab_size": len(tokenizer),
                "rope_theta": 1000000.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
                "pad_token_id": tokenizer.pad_token_id,
            },
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": 16,
            },
            vocab_size=len(tokenizer),
            image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        )
    )
    processor = processor_without_video("Qwen2VLProcessor")(
        image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16), tokenizer=tokenizer
    )
    clip_tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(seed + 1)
    clip = _clip_text_encoder(clip_tokenizer, hidden=32, with_projection=False)
    torch.manual_seed(seed + 2)
    transformer = Kandinsky5Transformer3DModel(
        in_visual_dim=latent_channels,
        in_text_dim=16,
        in_text_dim2=32,
        time_dim=32,
        out_visual_dim=latent_channels,
        patch_size=(1, 2, 2),
        model_dim=48,
        ff_dim=128,
        num_text_blocks=1,
        num_visual_blocks=1,
        axes_dims=(8, 8, 8),
        visual_cond=visual_cond,
    )
    for name, param in transformer.named_parameters():  # adaLN-zero: random gates, so every block and LoRA acts
        if "modulation.out_layer" in name:
            torch.nn.init.normal_(param, std=0.02)
    return {
        "transformer": transformer,
        "text_encoder": text_encoder,
        "tokenizer": processor,
        "text_encoder_2": clip,
        "tokenizer_2": clip_tokenizer,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
    }


def tiny_kandinsky5_tokenizer():
    """A byte-level BPE `Qwen2Tokenizer` with the Qwen special tokens whose merges keep every word of the Kandinsky 5
    prompt templates whole, so a template costs about as many tokens as with the real tokenizer (the pipelines drop
    the first 128 / 40 tokens and cut prompts at `max_sequence_length` after them)."""
    from diffusers.pipelines.kandinsky5.pipeline_kandinsky import Kandinsky5T2VPipeline
    from diffusers.pipelines.kandinsky5.pipeline_kandinsky_t2i import Kandinsky5T2IPipeline

    sources = [inspect.getsource(c.__init__) for c in (Kandinsky5T2VPipeline, Kandinsky5T2IPipeline)]
    texts = ["\n".join(codecs.decode(t, "unicode_escape") for t in re.findall(r'"([^"]*)"', src)) for src in sources]
    words = byte_level_words(*texts, "a cat dog red car")
    tokenizer = tiny_qwen2_tokenizer(merges=whole_word_merges(words), chat_template=None)
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer
