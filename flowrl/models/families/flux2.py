"""FLUX.2 [dev] and FLUX.2 [klein]: the adapters (2x2-patchified, packed latents with 4-D position ids; the shift
`mu` fitted to the image size *and* the step count), their options and tiny offline pipelines.

Both pipelines share `Flux2Transformer2DModel`, `AutoencoderKLFlux2` (whose batch-norm statistics normalise the
patchified latents) and the scheduling code (`compute_empirical_mu`); they differ in the text encoder (Mistral-3
Small behind a FLUX.2 system prompt for dev, Qwen3 for klein) and in guidance: dev is guidance-distilled (an
embedding), klein base runs true classifier-free guidance with the empty prompt, and the step-distilled klein
checkpoints (`is_distilled=True`) run without guidance.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.helpers import flux_forward, guidance_embedding
from flowrl.models.tiny import TINY_MERGES, _bytes_to_unicode, _eval, tiny_qwen2_tokenizer


@dataclasses.dataclass
class Flux2Options:
    """Options of the FLUX.2 families (text conditioning)."""

    max_sequence_length: int | None = None
    """Text tokens, padded to exactly this many (None: the pipeline's default, 512)."""
    text_encoder_out_layers: tuple[int, ...] | None = None
    """Text-encoder hidden states stacked into the conditioning (None: the pipeline's default, dev (10, 20, 30),
    klein (9, 18, 27))."""


LORA_TARGETS = (
    # double-stream blocks
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    # single-stream blocks (their output projection is `attn.to_out`, which `attn.to_out.0` does not match)
    "attn.to_qkv_mlp_proj",
)  # fmt: skip
"""Flow-Factory's `default_target_modules` for FLUX.2 and FLUX.2 klein (`src/flow_factory/models/flux/flux2.py`,
`flux2_klein.py`; its list names `attn.to_out.0` twice, once per stream, kept once here)."""


class _Flux2Adapter(ModelAdapter):
    """What FLUX.2 dev and klein share: latents, ids, schedule, decoding."""

    Options = Flux2Options
    lora_targets = LORA_TARGETS
    packed_latents = True

    def __init__(self, pipeline, *, options=None):
        super().__init__(pipeline, options=options)
        self._num_steps: int | None = None  # the step count of the last `schedule` (mu depends on it)

    @property
    def model(self):
        return self.pipeline.transformer

    def _text_kwargs(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self.options).items() if v is not None}

    def encode(self, prompts):
        # every prompt is padded to exactly max_sequence_length ("max_length"): no dependence on the batch
        embeds, _ = self.pipeline.encode_prompt(prompt=prompts, device=self.device, **self._text_kwargs())
        return {"prompt_embeds": embeds.to(self.dtype)}

    def _latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """Rows and columns of packed tokens (the patchified latent), as `prepare_latents` computes them."""
        vsf = self.pipeline.vae_scale_factor
        return int(height) // (vsf * 2), int(width) // (vsf * 2)

    def _latent_ids(self, batch: int, height: int, width: int) -> torch.Tensor:
        rows, cols = self._latent_grid(height, width)
        return self.pipeline._prepare_latent_ids(torch.empty(batch, 1, rows, cols, device="meta")).to(self.device)

    def static_inputs(self, height, width):
        return {"img_ids": self._latent_ids(1, height, width)[0]}  # `[h*w, 4]` (T, H, W, L) coordinates

    def _guidance(self, guidance_scale: float, n: int, device) -> torch.Tensor | None:
        return None

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        embeds = cond["prompt_embeds"]
        txt_ids = self.pipeline._prepare_text_ids(embeds[:1])[0].to(latents.device)  # `[L, 4]`, same for all rows
        return flux_forward(
            model or self.model,
            latents,
            timesteps,
            self._guidance(guidance_scale, latents.shape[0], latents.device),
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=static["img_ids"],
        )

    def initial_latents(self, batch_size, height, width, generator):
        packed = self.pipeline_latents(batch_size, height, width, generator)
        # `_pack_latents` returns a permuted view; every later state inherits its strides, and a stored (stacked,
        # contiguous) state would then go through other matmul kernels when re-scored: not bit for bit
        return packed.contiguous()

    def schedule(self, num_steps, latent_shape):
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if self.scheduler.config.get("use_flow_sigmas", False):
            sigmas = None
        # the pipeline passes mu unconditionally (a scheduler without dynamic shifting ignores it)
        mu = compute_empirical_mu(image_seq_len=latent_shape[1], num_steps=num_steps)
        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=sigmas, mu=mu)
        self._num_steps = num_steps
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def shift_mu(self, latent_shape, num_steps: int | None = None):
        """FLUX.2's `mu` is fitted to the packed sequence length and the step count (`compute_empirical_mu`):
        `num_steps` defaults to the last `schedule` call's, i.e. the grid the rollout runs on (what MixGRPO-Flash's
        `resample_sigmas` re-discretises)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        if not self.scheduler.config.get("use_dynamic_shifting", None):
            return None
        num_steps = num_steps or self._num_steps
        if num_steps is None:
            raise ValueError("FLUX.2's shift depends on the step count: call schedule() first or pass num_steps")
        return compute_empirical_mu(image_seq_len=latent_shape[1], num_steps=num_steps)

    def decode(self, latents, height, width):
        pipe = self.pipeline
        rows, cols = self._latent_grid(height, width)
        # the pipeline's `_unpack_latents_with_ids` scatters the tokens by their (row, column) ids, which run over the
        # grid row by row: the same as a reshape, without reading the grid's size back from the device
        latents = latents.view(latents.shape[0], rows, cols, latents.shape[-1]).permute(0, 3, 1, 2)
        bn_mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        bn_std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        latents = latents * bn_std.to(latents.device, latents.dtype) + bn_mean
        latents = pipe._unpatchify_latents(latents).to(pipe.vae.dtype)
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pt")


@register_family
class Flux2Adapter(_Flux2Adapter):
    """FLUX.2 [dev]: `Flux2Transformer2DModel`, Mistral-3 text encoder; guidance is an embedding.

    FLUX.2-dev is guidance-distilled: `guidance_scale` is fed to the guidance embedding (no second CFG branch),
    exactly as `Flux2Pipeline` does.
    """

    family = "flux2"
    pipeline_class = "Flux2Pipeline"
    real_models = ("black-forest-labs/FLUX.2-dev: 32B",)

    def uses_cfg(self, guidance_scale):
        return False

    def _guidance(self, guidance_scale, n, device):
        return guidance_embedding(self.model, guidance_scale, n, device)

    @staticmethod
    def tiny(seed: int = 0, latent_channels: int = 4):
        """A `Flux2Pipeline` with a 1+1-block transformer (guidance embedding on), a 30-layer toy Mistral-3 text
        encoder (the pipeline stacks hidden states 10, 20, 30) and a 4-level VAE (64x64 images are 4x4 tokens).

        The `tokenizer` slot holds a tokenizer, not the `PixtralProcessor` of the real checkpoint: that processor
        needs torchvision (`transformers` refuses to build it without), and `Flux2Pipeline` only calls
        `apply_chat_template` on it, which a tokenizer provides (text-only prompts).
        """
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

        tokenizer = tiny_mistral_tokenizer()
        torch.manual_seed(seed)
        transformer = _transformer(latent_channels, text_dim=3 * 16, guidance_embeds=True)
        torch.manual_seed(seed + 1)
        text_config = MistralConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=37,
            num_hidden_layers=30,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            max_position_embeddings=1024,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        vision_config = PixtralVisionConfig(
            hidden_size=16,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            image_size=30,
            patch_size=6,
        )
        text_encoder = Mistral3ForConditionalGeneration(
            Mistral3Config(
                text_config=text_config,
                vision_config=vision_config,
                image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
            )
        )
        torch.manual_seed(seed + 2)
        vae = _vae(latent_channels)
        return _eval(
            Flux2Pipeline(
                scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
                vae=vae,
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                transformer=transformer,
            )
        )


@register_family
class Flux2KleinAdapter(_Flux2Adapter):
    """FLUX.2 [klein]: `Flux2Transformer2DModel` without guidance embedding, Qwen3 text encoder, true CFG.

    The base checkpoints run classifier-free guidance against the empty prompt when `guidance_scale > 1`; the
    step-distilled ones (`is_distilled` in the pipeline config) ignore `guidance_scale`, as `Flux2KleinPipeline`
    does.
    """

    family = "flux2_klein"
    pipeline_class = "Flux2KleinPipeline"
    real_models = (
        "black-forest-labs/FLUX.2-klein-4B: 4B",
        "black-forest-labs/FLUX.2-klein-9B: 9B",
        "black-forest-labs/FLUX.2-klein-base-9B: 9B",
    )

    def uses_cfg(self, guidance_scale):
        return guidance_scale > 1 and not self.pipeline.config.is_distilled

    @staticmethod
    def tiny(seed: int = 0, latent_channels: int = 4, is_distilled: bool = False):
        """A `Flux2KleinPipeline` with a 1+1-block transformer (no guidance embedding), a 27-layer toy Qwen3 text
        encoder (the pipeline stacks hidden states 9, 18, 27) and a 4-level VAE (64x64 images are 4x4 tokens)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
        from transformers import Qwen3Config, Qwen3ForCausalLM

        tokenizer = tiny_qwen2_tokenizer()
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
        torch.manual_seed(seed)
        transformer = _transformer(latent_channels, text_dim=3 * 16, guidance_embeds=False)
        torch.manual_seed(seed + 1)
        text_encoder = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=16,
                intermediate_size=16,
                num_hidden_layers=27,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=1024,
                bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        torch.manual_seed(seed + 2)
        vae = _vae(latent_channels)
        return _eval(
            Flux2KleinPipeline(
                scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
                vae=vae,
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                transformer=transformer,
                is_distilled=is_distilled,
            )
        )


QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
"""ChatML with Qwen3's `enable_thinking=False` (an empty thinking block), which `Flux2KleinPipeline` asks for."""

MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' + text + '[/INST]' }}"
    "{% else %}{{ text + eos_token }}{% endif %}{% endfor %}"
)
"""Mistral-3 Small's turn format (`[SYSTEM_PROMPT]`, `[INST]`), for content given as a string or as typed parts."""


def tiny_mistral_tokenizer():
    """A byte-level BPE tokenizer with Mistral-3's control tokens and turn format, built in memory.

    FLUX.2's system prompt (`diffusers.pipelines.flux2.system_messages.SYSTEM_MESSAGE`) is one added token, so a
    short `max_sequence_length` still reaches the user's prompt after it (the real tokenizer spends ~40 tokens).
    """
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = [
        "<unk>",
        "<s>",
        "</s>",
        "<pad>",
        "[INST]",
        "[/INST]",
        "[SYSTEM_PROMPT]",
        "[/SYSTEM_PROMPT]",
        "[IMG]",
        "[IMG_BREAK]",
        "[IMG_END]",
    ]
    vocab = {token: i for i, token in enumerate(special)}
    vocab.update({c: len(special) + i for i, c in enumerate(_bytes_to_unicode())})
    merges = list(TINY_MERGES)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(SYSTEM_MESSAGE, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )


def _transformer(latent_channels: int, text_dim: int, guidance_embeds: bool):
    """A 1+1-block `Flux2Transformer2DModel` on 2x2-patchified latents (`4 * latent_channels` token channels)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_dim,  # 3 stacked hidden states x the text encoder's width
        timestep_guidance_channels=256,
        axes_dims_rope=(4, 4, 4, 4),  # (T, H, W, L), sums to the head dim
        guidance_embeds=guidance_embeds,
    )


def _vae(latent_channels: int):
    """A 4-level `AutoencoderKLFlux2` (`vae_scale_factor` 8, as the real one) with non-trivial batch-norm statistics
    of the patchified latents (the pipelines normalise by them)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.1 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    return vae
