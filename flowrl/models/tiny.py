"""Pieces of tiny random pipelines built offline from the real diffusers/transformers classes.

Each family builds its own tiny pipeline from these (`ModelAdapter.tiny`, in `flowrl.models.families`); for tests,
benchmarks and the examples in the docs: every component is the real architecture at a toy size, tokenizers are
built in code (no hub), and `torch.manual_seed(seed)` precedes each component so the same seed always gives the same
weights. Components are in eval mode, as `from_pretrained` returns them
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


QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>", "<think>", "</think>",
)  # fmt: skip
"""The Qwen2/Qwen3 special tokens the families' prompt templates use (chat turns, vision placeholders, thinking)."""

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML template (what Qwen tokenizers ship; Z-Image calls `apply_chat_template`)."""


TINY_MERGES = (("Ġ", "a"), ("c", "a"), ("ca", "t"), ("d", "o"), ("do", "g"))
"""The byte-level tokenizers' few merges (` a`, `cat`, `dog`), so that some words are one token."""


def byte_level_words(*texts: str) -> list[str]:
    """The distinct words of `texts` as a byte-level BPE tokenizer pre-tokenizes them (GPT-2's split, `Ġ` for a
    leading space), in order of first appearance."""
    from transformers import Qwen2Tokenizer

    plain = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(_bytes_to_unicode())}, merges=[])
    pre = plain._tokenizer.pre_tokenizer.pre_tokenize_str
    return list(dict.fromkeys(word for text in texts for word, _ in pre(text)))


def whole_word_merges(words, merges=()) -> list[tuple[str, str]]:
    """BPE merges that spell each of `words` as one token, after `merges`: left to right, each prefix of a word merges
    with its next character (a merge already listed is not repeated); an `(a, b)` pair among `words` is a merge of
    its own. A tiny tokenizer with these spends about as many tokens on a pipeline's prompt template as the real
    tokenizer does, so a template prefix a pipeline drops by count is the same text."""
    merges = list(merges)
    for word in words:
        if isinstance(word, tuple):
            merges += [word]
            continue
        merges += [(word[:i], word[i]) for i in range(1, len(word)) if (word[:i], word[i]) not in merges]
    return merges


def tiny_qwen2_tokenizer(extra_special: tuple[str, ...] = (), merges=TINY_MERGES, chat_template=QWEN_CHAT_TEMPLATE):
    """A byte-level BPE `Qwen2Tokenizer` (every string tokenizes) with the Qwen special tokens (and `extra_special`)
    and a ChatML chat template (None: none), built in memory: what Qwen-Image, Z-Image, FLUX.2 klein, HunyuanVideo
    1.5 and Kandinsky 5 tokenize with. `merges` (`whole_word_merges` keeps a template's words whole) add one token
    each after the 256 byte characters."""
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode())}
    merges = list(merges)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS + tuple(extra_special))})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tiny_gemma_tokenizer():
    """A byte-fallback `GemmaTokenizer` over lower-case letters, digits and punctuation (pad 0, eos 1, bos 2): what
    LTX-2's Gemma 3 tokenizes with."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    vocab.update({f"<0x{i:02X}>": 5 + i for i in range(256)})
    for c in "▁abcdefghijklmnopqrstuvwxyz0123456789.,!?'-\"":
        vocab.setdefault(c, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[])


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


def tiny_pipeline(family: str, seed: int = 0, **kwargs):
    """The tiny offline pipeline of a registered family (`flowrl list model_families`)."""
    from flowrl.models.families import MODEL_FAMILIES

    return MODEL_FAMILIES.get(family).tiny(seed=seed, **kwargs)


def tiny_sd3(seed: int = 0, **kwargs):
    """A tiny `StableDiffusion3Pipeline` (`flowrl.models.families.sd3.SD3Adapter.tiny`)."""
    return tiny_pipeline("sd3", seed, **kwargs)


def tiny_flux(seed: int = 0, **kwargs):
    """A tiny `FluxPipeline` (`flowrl.models.families.flux.FluxAdapter.tiny`)."""
    return tiny_pipeline("flux", seed, **kwargs)


def tiny_unet(seed: int = 0):
    """A tiny `StableDiffusionPipeline` (`flowrl.models.families.unet.UNetAdapter.tiny`)."""
    return tiny_pipeline("unet", seed)
