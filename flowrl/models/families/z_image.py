"""Z-Image: the adapter (Qwen3 chat-template prompts, per-sample caption lists, negated output), its options and a
tiny offline `ZImagePipeline`."""

from __future__ import annotations

import dataclasses

import torch

from flowrl.core.copies import to_device
from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.helpers import calculate_shift, decode_vae, dynamic_shift, pad_rows
from flowrl.models.tiny import _eval, _vae, tiny_qwen2_tokenizer


@dataclasses.dataclass
class ZImageOptions:
    """Options of a Z-Image model."""

    max_sequence_length: int | None = None
    """Text tokens of the chat-templated prompt (None: the pipeline's default, 512). Each prompt keeps only its
    own tokens (the padding is masked out), as `ZImagePipeline.encode_prompt` does."""
    cfg_normalization: float = 0.0
    """`ZImagePipeline`'s `cfg_normalization`: with CFG, a sample's guided prediction is rescaled so its norm is at
    most this times the norm of the conditional prediction (0: off, the pipeline's default)."""
    cfg_truncation: float = 1.0
    """`ZImagePipeline`'s `cfg_truncation`: steps whose normalised time `1 - sigma` exceeds this use the conditional
    prediction alone (1.0: never, the pipeline's default)."""


@register_family
class ZImageAdapter(ModelAdapter):
    """Z-Image: `ZImageTransformer2DModel` on per-sample latent lists, a Qwen3 text encoder, true CFG.

    Bit for bit `ZImagePipeline`: the network sees `(1000 - t) / 1000 = 1 - sigma` and its output is negated into
    the flow velocity (the pipeline negates before `scheduler.step`); latents are `[B, 16, h, w]` and go in as a
    list of one-frame `[16, 1, h, w]` tensors. CFG in flowrl's convention `uncond + s (text - uncond)` is the
    pipeline's `text + g (text - uncond)` with `g = s - 1` (`pipeline_call_kwargs`).
    """

    family = "z_image"
    attention_mask = "padded"
    Options = ZImageOptions
    pipeline_class = "ZImagePipeline"
    real_models = ("Tongyi-MAI/Z-Image: 6B", "Tongyi-MAI/Z-Image-Turbo: 6B")
    lora_targets = (
        "attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0",
        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
    )  # fmt: skip
    """Flow-Factory's Z-Image set (`src/flow_factory/models/z_image/z_image.py`, `default_target_modules`): the
    attention projections and the SwiGLU feed-forward of every block (refiners included)."""

    @property
    def model(self):
        return self.pipeline.transformer

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, batch_size: int, negative_prompt: str = "") -> dict:
        """`ZImagePipeline`'s CFG is `text + g (text - uncond)`, on whenever `g > 0`: flowrl's scale `s` is `g + 1`.

        The pipeline chat-templates a `negative_prompt` list in place, so a non-empty one is a list for one call only
        (the empty one is its default, left out).
        """
        kwargs = {"guidance_scale": guidance_scale - 1.0}
        return {**kwargs, "negative_prompt": [negative_prompt] * batch_size} if negative_prompt else kwargs

    def _max_length(self) -> int:
        return self.options.max_sequence_length or 512

    def encode(self, prompts):
        """`{"prompt_embeds": [P, L, D]` (each prompt's `hidden_states[-2]` tokens, zero-padded to `L =
        max_sequence_length`), `"prompt_lengths": [P]}`: the pipeline's ragged list at a fixed shape."""
        length = self._max_length()
        embeds = self.pipeline._encode_prompt(list(prompts), device=self.device, max_sequence_length=length)
        padded, lengths = pad_rows(embeds, length)  # lengths: host data, `forward` reads it
        return {"prompt_embeds": padded.to(self.dtype), "prompt_lengths": lengths}

    def _truncated(self, timesteps, guidance_scale) -> torch.Tensor | None:
        """`[N]` rows at which the pipeline switches CFG off (`cfg_truncation`), or None."""
        trunc = float(self.options.cfg_truncation)
        if not self.uses_cfg(guidance_scale) or trunc >= 1:  # `1 - sigma` never exceeds 1
            return None
        mask = (1000 - self.timesteps_on_host(timesteps).float()) / 1000 > trunc  # host data
        return mask if bool(mask.any()) else None

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        model = model or self.model
        n = latents.shape[0]
        embeds, lengths = cond["prompt_embeds"], cond["prompt_lengths"].tolist()
        captions = [embeds[i, : lengths[i]] for i in range(n)]
        t = (1000 - timesteps) / 1000
        truncated = self._truncated(timesteps, guidance_scale)
        rows = list(range(n))
        if truncated is not None:
            # the policy batches [uncond; text]: where CFG is off (`step_guidance` 1) the pipeline runs the text rows
            # alone, so only they are computed (and copied into the unconditional half)
            half = n // 2
            rows = [i for i in range(n) if i >= half or not bool(truncated[i])]
        x = list(latents.to(self.dtype).unsqueeze(2).unbind(0))
        t = t if len(rows) == n else t[to_device(torch.tensor(rows), t.device)]  # host rows: no wait
        out = model([x[i] for i in rows], t, [captions[i] for i in rows], return_dict=False)[0]
        by_row = dict(zip(rows, out))
        if truncated is not None:
            half = n // 2
            for i in range(half):
                if i not in by_row:
                    by_row[i] = by_row[i + half]
        return -torch.stack([by_row[i].float() for i in range(n)]).squeeze(2)  # the pipeline negates the output

    def step_guidance(self, guidance_scale, timesteps):
        """`guidance_scale`, or `[N, 1, 1, 1]` scales that are 1 (the conditional prediction alone) at the rows whose
        step is past `cfg_truncation`."""
        truncated = self._truncated(timesteps, guidance_scale)
        if truncated is None:
            return guidance_scale
        scale = torch.full(truncated.shape, float(guidance_scale), dtype=torch.float32)
        return scale.masked_fill(truncated, 1.0).view(-1, 1, 1, 1)  # host data (`combine_cfg` moves it)

    def combine_cfg(self, uncond, text, guidance_scale):
        """The pipeline's `text + (s - 1) (text - uncond)` (its `pos + g (pos - neg)`), renormalised per sample
        when `cfg_normalization` is set (except where CFG is truncated, `s = 1`, as the pipeline does)."""
        host = guidance_scale  # a per-row scale is host data (`step_guidance`)
        if isinstance(guidance_scale, torch.Tensor):
            guidance_scale = guidance_scale.to(text.device, non_blocking=True)
        pred = text + (guidance_scale - 1.0) * (text - uncond)
        factor = float(self.options.cfg_normalization)
        if factor <= 0.0:
            return pred
        scales = torch.as_tensor(host, dtype=torch.float32).reshape(-1).expand(pred.shape[0]).tolist()
        rows = []
        for j in range(pred.shape[0]):
            p = pred[j]
            if scales[j] != 1.0:
                max_norm = torch.linalg.vector_norm(text[j]) * factor
                new_norm = torch.linalg.vector_norm(p)
                p = torch.where(new_norm > max_norm, p * (max_norm / new_norm), p)  # no read of the device
            rows.append(p)
        return torch.stack(rows)

    def initial_latents(self, batch_size, height, width, generator):
        """fp32 noise `[B, C, h, w]`, as the pipeline draws it (its latents stay fp32; the network input is cast)."""
        return self.pipeline_latents(batch_size, height, width, generator, dtype=torch.float32)

    def schedule(self, num_steps, latent_shape):
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas, retrieve_timesteps

        # the pipeline always computes mu (the scheduler ignores it without dynamic shifting)
        mu = calculate_shift(self.scheduler.config, self._seq_len(latent_shape))
        sigmas = get_default_z_image_sigmas(num_steps)
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    @staticmethod
    def _seq_len(latent_shape) -> int:
        """The image's tokens (2x2 patches of the latent), the pipeline's `image_seq_len`."""
        return (latent_shape[-2] // 2) * (latent_shape[-1] // 2)

    def shift_mu(self, latent_shape):
        return dynamic_shift(self.scheduler.config, self._seq_len(latent_shape))

    def decode(self, latents, height, width):
        return decode_vae(self.pipeline, latents)

    def default_size(self):
        return 1024, 1024  # the pipeline's `height or 1024`

    @staticmethod
    def tiny(seed: int = 0):
        """A `ZImagePipeline` with a 2-layer `ZImageTransformer2DModel` (1 refiner layer each), a 2-layer `Qwen3Model`
        (hidden 16), a byte-level Qwen2 tokenizer with a ChatML template and a 3-level 16-channel VAE.

        64x64 images map to 16x16x16 latents (64 image tokens). The pad tokens are drawn at random (the real
        model's are trained, not zero), so padding that leaks would show.
        """
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
        from transformers import Qwen3Config, Qwen3Model

        tokenizer = tiny_qwen2_tokenizer()
        torch.manual_seed(seed)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=16,  # = the text encoder's hidden size
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[8, 4, 4],  # sums to the head dim
            axes_lens=[256, 32, 32],
        )
        with torch.no_grad():
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
        torch.manual_seed(seed + 1)
        config = Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            pad_token_id=tokenizer.pad_token_id,
        )
        text_encoder = Qwen3Model(config)
        torch.manual_seed(seed + 2)
        vae = _vae(16, shift=0.1159, scale=0.3611, block_out_channels=(8, 16, 16))  # vae_scale_factor 4
        return _eval(
            ZImagePipeline(
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                vae=vae,
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                transformer=transformer,
            )
        )
