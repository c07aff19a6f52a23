"""Qwen-Image: the adapter (packed latents, fixed-length masked text, renormalised true CFG), its options and a tiny
offline `QwenImagePipeline`."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.helpers import calculate_shift, dynamic_shift, flux_forward, guidance_embedding
from flowrl.models.tiny import QWEN_SPECIAL_TOKENS, TINY_MERGES, _eval, tiny_qwen2_tokenizer, whole_word_merges


@dataclasses.dataclass
class QwenImageOptions:
    """Options of the Qwen-Image family."""

    max_sequence_length: int = 512
    """Text tokens kept per prompt after the chat template's 34-token prefix is dropped (the pipeline's
    `max_sequence_length`, default 512, at most 1024). Every prompt's embeddings are zero-padded to this length with
    an attention mask, so a prompt's conditioning never depends on its batch; the masked padding does not change
    the prediction, but costs attention time: a shorter length suits short prompts."""

    def __post_init__(self):
        if not 1 <= self.max_sequence_length <= 1024:
            raise ValueError(f"model.options.max_sequence_length must be in [1, 1024], got {self.max_sequence_length}")


@register_family
class QwenImageAdapter(ModelAdapter):
    """Qwen-Image: `QwenImageTransformer2DModel` on 2x2-packed latents, Qwen2.5-VL text; true CFG renormalised.

    As `QwenImagePipeline`: the timestep is sigma (`t / 1000`), the shift `mu` follows the packed sequence length,
    and guidance is "true" CFG (a second branch on the negative prompt) whose combination is rescaled to the norm
    of the conditional prediction over each token's channels.
    """

    family = "qwen_image"
    attention_mask = "gaps"
    Options = QwenImageOptions
    pipeline_class = "QwenImagePipeline"
    real_models = ("Qwen/Qwen-Image: 20B", "Qwen/Qwen-Image-2512: 20B")
    """The model card's "20B MMDiT" (the 2512 release keeps the architecture)."""
    lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )  # fmt: skip
    """Flow-Factory's Qwen-Image set (`src/flow_factory/models/qwen_image/qwen_image.py`, `default_target_modules`):
    the attention projections of both streams and both MLP layers of each stream. Flow-Factory spells the second
    MLP layer `net.2.proj`, a name no module has (`net.2` is a plain `Linear`); this is `net.2`, as Flow-Factory's
    Qwen-Image-Edit-Plus set spells it."""
    packed_latents = True

    @property
    def model(self):
        return self.pipeline.transformer

    def uses_cfg(self, guidance_scale):
        # a guidance-distilled checkpoint feeds the scale to its embedding instead (as the pipeline's `guidance_scale`)
        return guidance_scale > 1.0 and not self.model.config.guidance_embeds

    def combine_cfg(self, uncond, text, guidance_scale):
        """`QwenImagePipeline`'s true CFG: `uncond + s (text - uncond)` rescaled, token by token, to the norm of the
        conditional prediction over the packed channels."""
        combined = uncond + guidance_scale * (text - uncond)
        cond_norm = torch.norm(text, dim=-1, keepdim=True)
        noise_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / noise_norm)

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, batch_size: int, negative_prompt: str = "") -> dict:
        """`QwenImagePipeline.__call__` arguments that guide as flowrl does: true CFG (`true_cfg_scale`) against
        `negative_prompt` (the policy's unconditional branch), one per image."""
        return {"true_cfg_scale": guidance_scale, "negative_prompt": [negative_prompt] * batch_size}

    def encode(self, prompts):
        """`QwenImagePipeline.encode_prompt`'s embeddings and mask, at a fixed length.

        As `_get_qwen_prompt_embeds`: the prompts in the chat template through the text encoder, the last hidden
        state without the template's first `drop_idx` tokens, cut to `max_sequence_length`, zeros after each
        prompt's end. The pipeline tokenizes to the batch's longest prompt (up to 1024 + `drop_idx` tokens) and
        pads the embeddings to it; here every prompt is tokenized to exactly `drop_idx + max_sequence_length`
        tokens, so each row is computed alike whatever it is batched with. The encoder is causal, so the tokens
        kept are the pipeline's (cutting the input where its output is cut changes nothing before the cut).
        """
        pipe, length = self.pipeline, self.options.max_sequence_length
        drop = pipe.prompt_template_encode_start_idx
        tokens = pipe.tokenizer(
            [pipe.prompt_template_encode.format(p) for p in prompts],
            max_length=drop + length,
            padding="max_length",
            truncation=True,
            padding_side="right",
            return_tensors="pt",
        ).to(self.device)
        out = pipe.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        )
        mask = tokens.attention_mask[:, drop:]
        embeds = torch.where(mask.bool()[..., None], out.hidden_states[-1][:, drop:], 0.0)
        return {"prompt_embeds": embeds.to(self.dtype), "prompt_embeds_mask": mask.long()}

    def static_inputs(self, height, width):
        vsf = self.pipeline.vae_scale_factor
        return {"img_shape": (1, height // vsf // 2, width // vsf // 2)}  # the pipeline's `img_shapes` entry

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        n = latents.shape[0]
        return flux_forward(
            model or self.model,
            latents,
            timesteps,
            guidance_embedding(self.model, guidance_scale, n, latents.device),
            encoder_hidden_states_mask=cond["prompt_embeds_mask"],
            encoder_hidden_states=cond["prompt_embeds"],
            img_shapes=[[static["img_shape"]]] * n,
        )

    def schedule(self, num_steps, latent_shape):
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        # the pipeline always passes mu (packed tokens: its image_seq_len); the scheduler uses it only with dynamic
        # shifting
        mu = calculate_shift(self.scheduler.config, latent_shape[1])
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def shift_mu(self, latent_shape):
        return dynamic_shift(self.scheduler.config, latent_shape[1])

    def decode(self, latents, height, width):
        pipe, vae = self.pipeline, self.pipeline.vae
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="pt")

    def default_size(self):
        size = self.pipeline.default_sample_size * self.pipeline.vae_scale_factor
        return size, size

    @staticmethod
    def tiny(seed: int = 0, latent_channels: int = 16, tokenizer=None):
        """A `QwenImagePipeline` with a 2-layer `QwenImageTransformer2DModel`, a 2-layer Qwen2.5-VL text encoder, a
        2-level `AutoencoderKLQwenImage` (`vae_scale_factor` 4: 64x64 images are 8x8 = 64 packed tokens) and the real
        Qwen-Image scheduler settings; the byte-level tokenizer, built in code, spends exactly the real tokenizer's
        34 tokens on the template's prefix, so the dropped prefix is the same text."""
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImagePipeline,
            QwenImageTransformer2DModel,
        )
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        tokenizer = tokenizer or tiny_qwen_image_tokenizer()  # (the edit families' keeps their template's words)
        text_dim = 32
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * latent_channels,  # 2x2 packed latents
            out_channels=latent_channels,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=text_dim,
            guidance_embeds=False,
            axes_dims_rope=(8, 4, 4),  # sums to the head dim
        )
        torch.manual_seed(seed + 1)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
        config = Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": text_dim,
                "intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "max_position_embeddings": 2048,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 2, 4]},
                "pad_token_id": tokenizer.pad_token_id,
                "bos_token_id": None,
                "eos_token_id": ids["<|im_end|>"],
            },
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": text_dim,
            },
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration(config)
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLQwenImage(
            base_dim=4,
            z_dim=latent_channels,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[round(0.1 * ((i % 5) - 2), 3) for i in range(latent_channels)],
            latents_std=[round(1.0 + 0.25 * (i % 4), 3) for i in range(latent_channels)],
        )
        # Qwen/Qwen-Image's scheduler_config.json (exponential dynamic shift, 256..8192 tokens -> 0.5..0.9,
        # shift_terminal 0.02; as pinned in a peer's test, not checked against the hub)
        scheduler = FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            base_shift=0.5,
            max_shift=0.9,
            shift_terminal=0.02,
            time_shift_type="exponential",
        )
        return _eval(
            QwenImagePipeline(
                transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer
            )
        )


_TEMPLATE_WORDS = ("system", "user", "assistant", "Describe") + tuple(
    "Ġ" + w
    for w in "the image by detailing color shape size texture quantity text spatial relationships of objects and "
    "background".split()
)
"""The words of `QwenImagePipeline`'s chat template (byte-level, `Ġ` = a leading space) that Qwen's tokenizer keeps
whole: with them as single tokens the prefix before the prompt is 34 tokens, the pipeline's `drop_idx`, and the
suffix after it 5."""


def tiny_qwen_image_tokenizer(extra_words: tuple = ()):
    """A byte-level BPE `Qwen2Tokenizer` (every string tokenizes) with the Qwen special tokens, a ChatML template and
    merges that keep the Qwen-Image template's words (and `extra_words`: words, or `(a, b)` merges) whole, built in
    memory."""
    return tiny_qwen2_tokenizer(merges=whole_word_merges(_TEMPLATE_WORDS + tuple(extra_words), TINY_MERGES))
