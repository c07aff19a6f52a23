"""Tiny random SD3, Flux and SD1.5-style pipelines built offline from the real diffusers/transformers classes.

For tests, benchmarks and the examples in the docs: every component is the real architecture at a toy
size, tokenizers are built in code (no hub), and `torch.manual_seed(seed)` precedes each component so the
same seed always gives the same weights. Components are in eval mode, as `from_pretrained` returns them
(T5's dropout would otherwise make prompt embeddings random). `save_pretrained(dir)` / `from_pretrained(dir)`
round-trip them.
"""

from __future__ import annotations

import torch


def _eval(pipeline):
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipeline


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable-character table (the byte-level BPE alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tiny_clip_tokenizer(max_length: int = 77):
    """A byte-level CLIP tokenizer (every string tokenizes) with a 520-token vocabulary."""
    from transformers import CLIPTokenizer

    chars = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": i + 256 for i, c in enumerate(chars)})
    merges = [("c", "a"), ("ca", "t</w>"), ("d", "o"), ("do", "g</w>")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def tiny_t5_tokenizer():
    """A unigram T5 tokenizer over lower-case letters, digits and punctuation (pad 0, eos 1, unk 2)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    pieces += [(c, -4.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def _clip_text_encoder(tokenizer, hidden: int = 32, projection: int = 32, with_projection: bool = True):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        projection_dim=projection,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _t5_encoder(tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_ff=37,
        d_kv=8,
        num_layers=2,
        num_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config)


def _vae(latent_channels: int, shift: float, scale: float, block_out_channels=(8, 16)):
    """A 2-level AutoencoderKL: images are 2x the latent size (`vae_scale_factor` 2)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(block_out_channels),
        up_block_types=("UpDecoderBlock2D",) * len(block_out_channels),
        block_out_channels=block_out_channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift,
        scaling_factor=scale,
    )


def tiny_sd3(seed: int = 0, latent_channels: int = 16):
    """A `StableDiffusion3Pipeline` with a 2-layer `SD3Transformer2DModel`, tiny CLIP x2 + T5 and a 2-level VAE.

    64x64 images map to 16x32x32 latents (or `latent_channels`).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    tokenizer, tokenizer_3 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=64,  # = T5 d_model
        caption_projection_dim=64,
        pooled_projection_dim=64,  # = 2 x CLIP projection
        pos_embed_max_size=32,
    )
    torch.manual_seed(seed + 1)
    text_encoder = _clip_text_encoder(tokenizer)
    torch.manual_seed(seed + 2)
    text_encoder_2 = _clip_text_encoder(tokenizer)
    torch.manual_seed(seed + 3)
    text_encoder_3 = _t5_encoder(tokenizer_3, 64)
    torch.manual_seed(seed + 4)
    vae = _vae(latent_channels, shift=0.0609, scale=1.5035)
    return _eval(
        StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer,
            text_encoder_3=text_encoder_3,
            tokenizer_3=tokenizer_3,
        )
    )


def tiny_flux(seed: int = 0, latent_channels: int = 16):
    """A `FluxPipeline` with a 1+1-block `FluxTransformer2DModel` (guidance embedding on), tiny CLIP + T5, VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # 2x2 packed latents
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,  # = T5 d_model
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),  # sums to the head dim
    )
    torch.manual_seed(seed + 1)
    text_encoder = _clip_text_encoder(tokenizer, with_projection=False)
    torch.manual_seed(seed + 2)
    text_encoder_2 = _t5_encoder(tokenizer_2, 32)
    torch.manual_seed(seed + 3)
    vae = _vae(latent_channels, shift=0.1159, scale=0.3611)
    return _eval(
        FluxPipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
        )
    )


def tiny_unet(seed: int = 0):
    """A `StableDiffusionPipeline` with a tiny `UNet2DConditionModel`, CLIP text encoder, VAE and `DDIMScheduler`."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    torch.manual_seed(seed + 1)
    text_encoder = _clip_text_encoder(tokenizer, with_projection=False)
    torch.manual_seed(seed + 2)
    vae = _vae(4, shift=None, scale=0.18215)
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return _eval(
        StableDiffusionPipeline(
            unet=unet,
            scheduler=scheduler,
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    )
