"""SANA: the adapter (Gemma-2 text with an attention mask, DC-AE latents), its options and a tiny offline
`SanaPipeline`."""

from __future__ import annotations

import dataclasses
import inspect
import re

import torch

from flowrl.models.adapter import ModelAdapter
from flowrl.models.families import register_family
from flowrl.models.helpers import decode_vae
from flowrl.models.tiny import _eval, whole_word_merges


def complex_human_instruction() -> list[str]:
    """`SanaPipeline.__call__`'s default `complex_human_instruction` (read from its signature, so it is the
    pipeline's own text)."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


@dataclasses.dataclass
class SanaOptions:
    """Options of the SANA family."""

    max_sequence_length: int | None = None
    """Gemma tokens kept per prompt (None: the pipeline's default, 300). Prompts are padded to this length and the
    attention mask travels with the embeddings, so a prompt's conditioning never depends on its batch."""

    complex_human_instruction: bool = True
    """Prepend `SanaPipeline`'s complex human instruction to every prompt before Gemma encodes it (the pipeline's
    default; the negative prompt is encoded without it, as the pipeline does). False: the bare prompt."""


@register_family
class SanaAdapter(ModelAdapter):
    """SANA / SANA 1.5: `SanaTransformer2DModel` (linear attention) on DC-AE latents, Gemma-2 text, flow matching.

    Classifier-free guidance as `SanaPipeline`: both branches batched, `uncond + s (text - uncond)`, the unconditional
    branch the negative prompt (default `""`) encoded without the complex human instruction. The network sees
    `t * transformer.config.timestep_scale`; a learned-sigma output (`out_channels == 2 * in_channels`) keeps its
    first half. flowrl samples at the requested size: the pipeline's `use_resolution_binning` (snap to an
    aspect-ratio bin, resize back after decoding) is not applied.

    The hub checkpoints ship a flow-prediction `DPMSolverMultistepScheduler`; flowrl steps its own flow kernels from a
    sigma schedule, so the adapter's private scheduler is a `FlowMatchEulerDiscreteScheduler` with the checkpoint's
    `flow_shift` (the sigmas `SanaPipeline` runs with that scheduler swapped in).
    """

    family = "sana"
    Options = SanaOptions
    pipeline_class = "SanaPipeline"
    real_models = (
        "Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers: 1.6B",
        "Efficient-Large-Model/SANA1.5_4.8B_1024px_diffusers: 4.8B",
    )
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    """No published RL recipe for SANA sets its own: every attention projection (the linear self-attention `attn1`
    and the cross-attention `attn2` of each block), the set Flow-GRPO trains on SD3 minus the context stream SANA
    does not have. The Mix-FFN (`ff.conv_inverted`, `ff.conv_point`) is 1x1 convolutions, left out as the other
    families leave their feed-forwards out."""
    negative_differs = True
    """The negative prompt is encoded without the complex human instruction (`encode_negative`)."""

    def __init__(self, pipeline, *, options=None):
        super().__init__(pipeline, options=options)
        self.scheduler = flow_match_scheduler(self.scheduler)

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, batch_size: int, negative_prompt: str = "") -> dict:
        """`SanaPipeline.__call__` arguments that sample as flowrl does: at the requested size (no resolution
        binning), guided against `negative_prompt`."""
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt, "use_resolution_binning": False}

    @property
    def model(self):
        return self.pipeline.transformer

    def _encode(self, prompts, instruction: bool):
        kwargs = {}
        if self.options.max_sequence_length is not None:
            kwargs["max_sequence_length"] = self.options.max_sequence_length
        embeds, mask, _, _ = self.pipeline.encode_prompt(
            prompts,
            do_classifier_free_guidance=False,
            device=self.device,
            complex_human_instruction=complex_human_instruction() if instruction else None,
            **kwargs,
        )
        return {"prompt_embeds": embeds.to(self.dtype), "attention_mask": mask}

    def encode(self, prompts):
        return self._encode(prompts, self.options.complex_human_instruction)

    def encode_negative(self, prompts):
        return self._encode(prompts, False)

    def forward(self, latents, timesteps, cond, guidance_scale, model=None, static=None):
        out = (model or self.model)(
            latents.to(self.dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(self.dtype),
            encoder_attention_mask=cond["attention_mask"],
            timestep=timesteps * self.model.config.timestep_scale,
            return_dict=False,
        )[0]
        config = self.model.config  # (the bare model's: a DDP wrapper has no config)
        if config.out_channels // 2 == config.in_channels:  # learned sigma: the velocity is the first half
            out = out.chunk(2, dim=1)[0]
        return out

    def initial_latents(self, batch_size, height, width, generator):
        # drawn in fp32, as the pipeline draws them
        return self.pipeline_latents(batch_size, height, width, generator, dtype=torch.float32).to(self.dtype)

    def schedule(self, num_steps, latent_shape):
        from diffusers.pipelines.sana.pipeline_sana import retrieve_timesteps

        timesteps, _ = retrieve_timesteps(self.scheduler, num_steps, "cpu")
        return timesteps, self.scheduler.sigmas.to(torch.float32)

    def decode(self, latents, height, width):
        return decode_vae(self.pipeline, latents)

    @staticmethod
    def tiny(seed: int = 0):
        """A `SanaPipeline` with a 1-layer `SanaTransformer2DModel`, a 1-layer Gemma-2, a byte-fallback
        `GemmaTokenizer` built in memory and a 3-level `AutoencoderDC`.

        64x64 images map to 4x16x16 latents (DC-AE compression 4, patch 1: 256 tokens); `sample_size` 16 makes the
        default size 64. diffusers' own tiny SANA test config otherwise (`tests/pipelines/sana/test_sana.py`).
        """
        from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
        from transformers import Gemma2Config, Gemma2Model

        tokenizer = tiny_gemma_tokenizer()
        torch.manual_seed(seed)
        transformer = SanaTransformer2DModel(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_attention_heads=2,
            attention_head_dim=4,
            num_cross_attention_heads=2,
            cross_attention_head_dim=4,
            cross_attention_dim=8,
            caption_channels=8,  # = Gemma hidden size
            sample_size=16,
        )
        torch.manual_seed(seed + 1)
        vae = AutoencoderDC(
            in_channels=3,
            latent_channels=4,
            attention_head_dim=2,
            encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8, 8),
            decoder_block_out_channels=(8, 8, 8),
            encoder_qkv_multiscales=((), (), (5,)),
            decoder_qkv_multiscales=((), (), (5,)),
            encoder_layers_per_block=(1, 1, 1),
            decoder_layers_per_block=(1, 1, 1),
            downsample_block_type="conv",
            upsample_block_type="interpolate",
            decoder_norm_types="rms_norm",
            decoder_act_fns="silu",
            scaling_factor=0.41407,
        )
        torch.manual_seed(seed + 2)
        text_encoder = Gemma2Model(
            Gemma2Config(
                head_dim=16,
                hidden_size=8,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                attn_implementation="eager",
            )
        )
        return _eval(
            SanaPipeline(
                tokenizer=tokenizer,
                text_encoder=text_encoder,
                vae=vae,
                transformer=transformer,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),  # diffusers' SANA test scheduler
            )
        )


def flow_match_scheduler(scheduler):
    """`scheduler` as a `FlowMatchEulerDiscreteScheduler`: itself if it is one, else one with its `flow_shift` and
    `num_train_timesteps` (the hub's flow-prediction `DPMSolverMultistepScheduler`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    config = scheduler.config
    if config.get("prediction_type") != "flow_prediction" and not config.get("use_flow_sigmas", False):
        raise ValueError(f"a SANA pipeline needs a flow-matching scheduler, got {type(scheduler).__name__}")
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=config.get("num_train_timesteps", 1000), shift=float(config.get("flow_shift", 1.0))
    )


def tiny_gemma_tokenizer():
    """A byte-fallback BPE `GemmaTokenizer` built in memory (every string tokenizes; pad 0, eos 1, bos 2, unk 3,
    mask 4; `<bos>` first, as Gemma's, which `SanaPipeline.encode_prompt` keeps).

    Printable ASCII characters, `▁` (space) and the 256 byte tokens, plus merges that spell each word of the complex
    human instruction whole, so the instruction is ~200 tokens (as with Gemma's own vocabulary), not ~1,000.
    """
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for piece in [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + [chr(c) for c in range(33, 127)]:
        vocab[piece] = len(vocab)
    text = "\n".join(complex_human_instruction()).replace(" ", "▁")
    merges = whole_word_merges(dict.fromkeys(re.findall(r"▁?[A-Za-z]+", text)))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
