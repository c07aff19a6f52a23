"""Qwen-Image 2.1 text-to-image (`qwen_image_21`): the adapter, its options and a tiny offline `QwenImage21Pipeline`.

One block-causal single-stream transformer reads `[text | image]`: the text (Qwen3-VL's hidden states over the prompt
after the pipeline's system turn) attends causally, the image's tokens (64 latent channels, one per 16x16 pixels, not
patched) attend to everything. With `causal_condition` the text is modulated from `t = 0`, so the pipeline caches its
keys and values after the first step (`use_kv_cache`); flowrl computes every step whole (the cache changes the
rounding, and re-scoring must repeat the rollout's arithmetic), and its diffusers lines pass `use_kv_cache=False`.

The image's rotary positions continue after the text, so a prompt's prediction depends on its text length, and the
pipeline pads a batch's prompts to the longest: its batched output depends on the batch. flowrl keeps each prompt's
own tokens (stored zero-padded with its length) and runs the network on the rows of each text length apart, so a
sample never depends on its batch; it equals the pipeline's for one prompt per call (`pipeline_pads_prompts`).

Guidance is the pipeline's true CFG, `uncond + s (text - uncond)` against the negative prompt (`true_cfg_scale`; the
model is meant to sample without it: scale 1). The VAE decodes RGBA: flowrl's images are its RGB channels (alpha
dropped, as PIL's `convert("RGB")` drops it). Image-conditioned generation (the pipeline's `image`) is not wired.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.families.qwen_image import tiny_qwen_image_tokenizer
from flowrl.models.helpers import (
    calculate_shift,
    dynamic_shift,
    load_component,
    pad_rows,
    per_text_length,
    processor_without_video,
)
from flowrl.models.tiny import QWEN_SPECIAL_TOKENS, _eval


@dataclasses.dataclass
class QwenImage21Options:
    """Options of Qwen-Image 2.1 (`model.options`)."""

    text_tokens: int = 512
    """Text tokens a prompt may have after the system turn: the pipeline keeps every token (it truncates nothing),
    so a longer prompt is refused. Each prompt keeps its own tokens (stored zero-padded to this length; the network
    reads only a prompt's own)."""

    def __post_init__(self):
        if self.text_tokens < 1:
            raise ValueError(f"model.options.text_tokens must be >= 1, got {self.text_tokens}")


@register_family
class QwenImage21Adapter(ModelAdapter):
    """Qwen-Image 2.1: `QwenImage21Transformer2DModel` (block-causal, one stream), Qwen3-VL text, true CFG.

    As the pipeline: unpatched latents, the timestep is sigma, the shift `mu` follows the image's token count."""

    family = "qwen_image_21"
    attention_mask = "causal"
    Options = QwenImage21Options
    pipeline_class = "QwenImage21Pipeline"
    pipeline_pads_prompts = True
    real_models = ("Qwen/Qwen-Image-2.1: 7B",)
    """The README's 7B for the generator (32 blocks of 4096; 7.0B counted from the published config)."""
    lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "img_mlp.proj",
        "img_mlp.gate_layer",
        "img_mlp.out",
    )
    """Flow-Factory's Qwen-Image 2.1 set (`src/flow_factory/models/qwen_image_21/qwen_image_21.py`,
    `default_target_modules`): every block's attention projections and SwiGLU layers; the shared modulation, the
    input projections and the output layer stay frozen."""

    @property
    def model(self):
        return self.pipeline.transformer

    @classmethod
    def pipeline_load_kwargs(cls, name_or_path: str) -> dict:
        """The Qwen3-VL processor, loaded without the video processor that needs torchvision."""
        return {"processor": load_component(processor_without_video("Qwen3VLProcessor"), name_or_path, "processor")}

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, batch_size: int, negative_prompt: str = "") -> dict:
        """True CFG against the negative prompt per image, each step computed whole (no KV cache), as flowrl does."""
        return {
            "true_cfg_scale": guidance_scale,
            "negative_prompt": [negative_prompt] * batch_size,
            "use_kv_cache": False,
        }

    # ----- conditioning -----

    def encode(self, prompts):
        """Each prompt alone through `encode_prompt`: its embeddings zero-padded to `text_tokens` `[P, L, D]`
        and its token count `prompt_lengths [P]` (host data: `forward` groups the rows by it)."""
        length, rows = self.options.text_tokens, []
        for prompt in prompts:
            embeds, _, _ = self.pipeline.encode_prompt(prompt=[prompt], device=self.device)
            if embeds.shape[1] > length:
                raise ValueError(
                    f"{self.family}: the prompt {prompt[:40]!r} needs {embeds.shape[1]} text tokens, more than "
                    f"model.options.text_tokens={length}"
                )
            rows.append(embeds[0])
        padded, lengths = pad_rows(rows, length)
        return {"prompt_embeds": padded.to(self.dtype), "prompt_lengths": lengths}

    # ----- the network -----

    def static_inputs(self, height, width):
        """The latent grid `(h, w)` of the rollout's size (multiples of 32 pixels, as the pipeline floors them)."""
        if height % 32 or width % 32:
            raise ValueError(f"{self.family} samples sizes that are multiples of 32 pixels, got {height} x {width}")
        return {"grid": (height // self.pipeline.vae_scale_factor, width // self.pipeline.vae_scale_factor)}

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        """The velocity `[N, S, C]`: one network call per text length among the rows, as the pipeline's call for one
        prompt of that length (its image slots: one per 2x2 latent tokens, after the text)."""
        model = model or self.model
        height, width = static["grid"]
        tokens = latents.shape[1]

        def predict(rows, length):
            slots = torch.ones(len(rows), length + tokens // 4, dtype=torch.bool, device=latents.device)
            slots[:, :length] = False
            pred = model(
                hidden_states=latents[rows],
                encoder_hidden_states=cond["prompt_embeds"][rows, :length].to(latents.dtype),
                timestep=timesteps[rows.to(timesteps.device)].to(latents.dtype) / 1000,
                img_shapes=[[(1, height, width)]] * len(rows),
                img_mask=slots,
                return_dict=False,
            )[0]
            return pred[:, -tokens:]

        return per_text_length(latents, cond["prompt_lengths"].tolist(), predict)

    # ----- the state -----

    def initial_latents(self, batch_size, height, width, generator):
        """Packed `[B, (H/16)(W/16), C]` noise drawn as the pipeline's `prepare_latents` draws it."""
        latents = self.pipeline_latents(batch_size, height, width, generator, image=True)
        return latents.contiguous()  # (the pipeline's packing is a transposed view: a step's reductions follow it)

    def schedule(self, num_steps, latent_shape):
        """The pipeline's sigmas: the checkpoint's `sample_sigmas` when it has `num_steps` of them, else
        `linspace(1, 1/n, n)` (what the pipeline uses without them), through the scheduler at the shift `mu`."""
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import retrieve_timesteps

        sigmas = self.pipeline.config.get("sample_sigmas")
        if sigmas is None or len(sigmas) != num_steps:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        # the pipeline always passes mu (the image's tokens); the scheduler uses it only with dynamic shifting
        mu = calculate_shift(self.scheduler.config, latent_shape[1])
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def shift_mu(self, latent_shape):
        return dynamic_shift(self.scheduler.config, latent_shape[1])

    def decode(self, latents, height, width):
        """Images `[B, 3, H, W]` in [0, 1]: the pipeline's de-normalisation and decode, its RGB channels."""
        pipe, vae = self.pipeline, self.pipeline.vae
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="pt")[:, :3]

    def default_size(self):
        """1024 x 1024 (the pipeline's `output_resolution`)."""
        return 1024, 1024

    @staticmethod
    def tiny(seed: int = 0):
        """A `QwenImage21Pipeline` at toy sizes: a 2-block transformer (8 latent channels), a 2-layer Qwen3-VL (with
        its 1-block vision tower) behind a processor built in code, and a 5-level `AutoencoderKLQwenImage21` (16x, as
        the pipeline assumes: 64x64 -> 4 x 4 tokens); Qwen-Image's dynamic-shift scheduler settings."""
        from diffusers import (
            AutoencoderKLQwenImage21,
            FlowMatchEulerDiscreteScheduler,
            QwenImage21Pipeline,
            QwenImage21Transformer2DModel,
        )
        from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

        tokenizer = tiny_qwen_image_tokenizer(extra_words=_SYSTEM_WORDS)
        tokenizer.chat_template = CHAT_TEMPLATE
        images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=32 * 32 * 16)
        processor_class = processor_without_video("Qwen3VLProcessor")
        processor = processor_class(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
        torch.manual_seed(seed)
        text_encoder = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(
                text_config={
                    "vocab_size": len(tokenizer),
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "head_dim": 8,
                    "max_position_embeddings": 2048,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1]},
                    "pad_token_id": tokenizer.pad_token_id,
                },
                vision_config={
                    "depth": 1,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_heads": 4,
                    "out_hidden_size": 32,
                    "patch_size": 16,
                    "spatial_merge_size": 2,
                    "num_position_embeddings": 64,
                    "deepstack_visual_indexes": [0],
                },
                image_token_id=ids["<|image_pad|>"],
                video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"],
                vision_end_token_id=ids["<|vision_end|>"],
            )
        )
        torch.manual_seed(seed + 1)
        transformer = QwenImage21Transformer2DModel(
            in_channels=8,
            out_channels=8,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            context_in_dim=32,
            mlp_ratio=2,
            axes_dims_rope=(4, 6, 6),  # sums to the head dim
        )
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLQwenImage21(
            base_dim=8,
            decoder_base_dim=8,
            z_dim=8,
            dim_mult=[1, 1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False] * 4,
            latents_mean=[round(0.1 * ((i % 5) - 2), 3) for i in range(8)],
            latents_std=[round(1.0 + 0.25 * (i % 4), 3) for i in range(8)],
        )
        scheduler = FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            base_shift=0.5,
            max_shift=0.9,
            shift_terminal=0.02,
            time_shift_type="exponential",
        )
        pipe = QwenImage21Pipeline(
            scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor, transformer=transformer
        )
        return _eval(pipe)


_SYSTEM_WORDS = ("Comprehend", "Ġand", "Ġanalyze", "Ġthe", "Ġprovided", "Ġprompt")
"""The words of the pipeline's system turn, kept whole by the tiny tokenizer (its prefix: 12 tokens)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML over string or typed content (the pipeline counts its system turn's tokens with a typed message)."""
