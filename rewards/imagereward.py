"""ImageReward (Xu et al. 2023, arXiv:2304.05977) rebuilt on transformers' BLIP classes.

The released model (THUDM/ImageReward, `ImageReward.py`) is BLIP: a ViT-L/16 image encoder at 224 px and a
BERT-base text encoder whose every layer cross-attends to the image tokens, then the linear MLP head
768 -> 1024 -> 128 -> 64 -> 16 -> 1 on the text encoder's first token:

    e   = BertWithCrossAttention(ids(prompt), image_tokens = ViT(preprocess(x)))[:, 0]
    r   = (MLP(e) - 0.16717362830052426) / 1.0333394966054072

The prompt is tokenized with the `bert-base-uncased` tokenizer (plus BLIP's added `[DEC]` and `[ENC]` tokens),
`padding="max_length", truncation=True, max_length=35`, and the ids go in as tokenized: the official scoring
paths (`ImageReward.score`, `inference_rank`, ReFL's `score_gard`) keep `[CLS]` first and do not substitute
BLIP's `[ENC]` token (BLIP's own image-text-matching head does); `enc_token=True` substitutes it.
Preprocessing: resize the shortest side to 224 (bicubic), centre crop, OpenAI CLIP mean/std.

The official package does not work with transformers 5, so this module maps the `ImageReward.pt` state dict
onto `BlipVisionModel` (timm-style ViT keys renamed) and `BlipTextModel` (same keys as BLIP's `med.BertModel`,
except the `embeddings.position_ids` buffer). Differentiable.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from torch import nn

from flowrl.rewards import register
from flowrl.rewards.base import Reward
from flowrl.rewards.heads import MLPHead
from flowrl.rewards.loading import check_tokenizer, download_hint, load_pretrained, load_state_dict, resolve_file
from flowrl.rewards.preprocess import ImageSettings


IMAGEREWARD_REPO = "THUDM/ImageReward"
CHECKPOINT_FILE = "ImageReward.pt"
BERT_REPO = "google-bert/bert-base-uncased"
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
MIN_VOCAB_SIZE = 30000  # bert-base-uncased has 30522 tokens; offline transformers 5 silently returns 5

# timm-style BLIP ViT keys -> transformers BlipVisionModel keys (regex, replacement).
_VISION_RENAMES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.(weight|bias)$", r"embeddings.patch_embedding.\1"),
    (r"^blocks\.(\d+)\.norm1\.(weight|bias)$", r"encoder.layers.\1.layer_norm1.\2"),
    (r"^blocks\.(\d+)\.norm2\.(weight|bias)$", r"encoder.layers.\1.layer_norm2.\2"),
    (r"^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$", r"encoder.layers.\1.self_attn.qkv.\2"),
    (r"^blocks\.(\d+)\.attn\.proj\.(weight|bias)$", r"encoder.layers.\1.self_attn.projection.\2"),
    (r"^blocks\.(\d+)\.mlp\.fc([12])\.(weight|bias)$", r"encoder.layers.\1.mlp.fc\2.\3"),
    (r"^norm\.(weight|bias)$", r"post_layernorm.\1"),
]
# Parts of the released checkpoint that scoring does not use (BLIP's contrastive projections).
_UNUSED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")


def _vision_key(key: str) -> str:
    for pattern, replacement in _VISION_RENAMES:
        new, n = re.subn(pattern, replacement, key)
        if n:
            return new
    raise ValueError(f"unexpected ImageReward vision key 'blip.visual_encoder.{key}'")


def map_imagereward_state_dict(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Split the official `ImageReward.pt` state dict into `{"vision", "text", "head"}` transformers state dicts.

    `blip.visual_encoder.*` (timm ViT) -> `BlipVisionModel`; `blip.text_encoder.*` -> `BlipTextModel` (names
    unchanged, the `embeddings.position_ids` buffer dropped); `mlp.layers.*` -> `MLPHead`; BLIP's
    `vision_proj`/`text_proj` are unused and dropped. Any other key raises a `ValueError`.
    """
    parts: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "text": {}, "head": {}}
    unknown = []
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            parts["vision"][_vision_key(key[len("blip.visual_encoder.") :])] = value
        elif key.startswith("blip.text_encoder."):
            rest = key[len("blip.text_encoder.") :]
            if rest != "embeddings.position_ids":
                parts["text"][rest] = value
        elif key.startswith("mlp."):
            parts["head"][key[len("mlp.") :]] = value
        elif not key.startswith(_UNUSED_PREFIXES):
            unknown.append(key)
    if unknown:
        raise ValueError(f"not an ImageReward checkpoint: unexpected keys {unknown[:5]}")
    for name, part in parts.items():
        if not part:
            raise ValueError(f"not an ImageReward checkpoint: it has no {name} weights")
    return parts


def _count(state: dict[str, torch.Tensor], pattern: str) -> int:
    indices = {int(m.group(1)) for key in state if (m := re.match(pattern, key))}
    return max(indices) + 1 if indices else 0


def vision_config_from(state: dict[str, torch.Tensor], head_dim: int = 64):
    """The `BlipVisionConfig` whose shapes match a mapped vision state dict (BLIP ViT: 64-d heads, LN eps 1e-6)."""
    from transformers import BlipVisionConfig

    hidden = int(state["embeddings.class_embedding"].shape[-1])
    patch = int(state["embeddings.patch_embedding.weight"].shape[-1])
    side = math.isqrt(int(state["embeddings.position_embedding"].shape[1]) - 1)
    return BlipVisionConfig(
        hidden_size=hidden,
        intermediate_size=int(state["encoder.layers.0.mlp.fc1.weight"].shape[0]),
        num_hidden_layers=_count(state, r"^encoder\.layers\.(\d+)\."),
        num_attention_heads=max(1, hidden // head_dim),
        image_size=side * patch,
        patch_size=patch,
        layer_norm_eps=1e-6,
        hidden_act="gelu",
    )


def text_config_from(state: dict[str, torch.Tensor], head_dim: int = 64):
    """The `BlipTextConfig` whose shapes match a text state dict (BERT-base: 64-d heads, LN eps 1e-12)."""
    from transformers import BlipTextConfig

    vocab, hidden = (int(n) for n in state["embeddings.word_embeddings.weight"].shape)
    if "encoder.layer.0.crossattention.self.key.weight" not in state:
        raise ValueError("the ImageReward text encoder has no cross-attention weights")
    return BlipTextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        encoder_hidden_size=int(state["encoder.layer.0.crossattention.self.key.weight"].shape[1]),
        intermediate_size=int(state["encoder.layer.0.intermediate.dense.weight"].shape[0]),
        num_hidden_layers=_count(state, r"^encoder\.layer\.(\d+)\."),
        num_attention_heads=max(1, hidden // head_dim),
        max_position_embeddings=int(state["embeddings.position_embeddings.weight"].shape[0]),
        layer_norm_eps=1e-12,
        hidden_act="gelu",
        is_decoder=True,  # in transformers this flag builds the cross-attention layers; forward stays bidirectional
        pad_token_id=0,
    )


class ImageRewardModel(nn.Module):
    """BLIP image encoder + cross-attending text encoder + MLP head, returning normalised ImageReward scores."""

    def __init__(self, vision_config, text_config, head: MLPHead):
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        self.vision = BlipVisionModel(vision_config)
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = head

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        image_tokens = self.vision(pixel_values=pixel_values).last_hidden_state  # [B, 1 + patches, D_img]
        image_mask = torch.ones(image_tokens.shape[:2], dtype=torch.long, device=image_tokens.device)
        text = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_tokens,
            encoder_attention_mask=image_mask,
        ).last_hidden_state
        raw = self.head(text[:, 0].float())[:, 0]  # the official code casts the features to fp32 for the MLP
        return (raw - REWARD_MEAN) / REWARD_STD


def load_bert_tokenizer(reward: str, location, *, min_vocab_size: int = MIN_VOCAB_SIZE):
    """BLIP's tokenizer: `bert-base-uncased` plus `[DEC]` (bos) and `[ENC]`, refusing a near-empty vocabulary."""
    from transformers import BertTokenizer

    path = Path(str(location)).expanduser()
    if path.is_file():  # a vocab.txt path: the tokenizer reads its folder
        location = str(path.parent)
    needs = "vocab.txt of bert-base-uncased (30522 tokens)"
    fix = (
        f"run {download_hint(BERT_REPO, ['vocab.txt', 'tokenizer_config.json'])} and pass tokenizer=DIR "
        "(config: `rewards: [{name: imagereward, kwargs: {tokenizer: DIR}}]`)"
    )
    tokenizer = load_pretrained(
        reward, BertTokenizer.from_pretrained, location, what="tokenizer", needs=needs, fix=fix
    )
    check_tokenizer(reward, tokenizer, minimum=min_vocab_size, location=location, needs=needs, fix=fix)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


def load_imagereward(
    checkpoint,
    tokenizer,
    *,
    reward: str = "imagereward",
    head_dim: int = 64,
    min_vocab_size: int = MIN_VOCAB_SIZE,
):
    """`(ImageRewardModel, tokenizer)` from the official checkpoint and a BERT tokenizer folder.

    Args:
        checkpoint: `ImageReward.pt` (or a `.safetensors` conversion), a folder holding it, or a hub repo id.
        tokenizer: a folder with `vocab.txt` of `bert-base-uncased` (or the file itself, or a hub id).
        head_dim (`int`, defaults to 64): attention head size used to infer head counts from the weights
            (ViT-L: 1024 / 64 = 16 heads, BERT-base: 768 / 64 = 12).
        min_vocab_size (`int`, defaults to 30000): smaller tokenizers are refused.
    """
    fix = (
        f"run {download_hint(IMAGEREWARD_REPO, [CHECKPOINT_FILE])} and pass checkpoint=DIR/{CHECKPOINT_FILE} "
        "(config: `rewards: [{name: imagereward, kwargs: {checkpoint: PATH, tokenizer: DIR}}]`)"
    )
    path = resolve_file(
        reward, checkpoint, [CHECKPOINT_FILE, "ImageReward.safetensors"], what="ImageReward checkpoint", fix=fix
    )
    tok = load_bert_tokenizer(reward, tokenizer, min_vocab_size=min_vocab_size)
    try:
        parts = map_imagereward_state_dict(load_state_dict(reward, path))
    except ValueError as err:
        raise ValueError(f"reward {reward!r}: {str(path)!r}: {err}") from err
    vision_config = vision_config_from(parts["vision"], head_dim)
    text_config = text_config_from(parts["text"], head_dim)
    head = MLPHead.from_state_dict(parts["head"], what=f"reward {reward!r} head")
    if len(tok) != text_config.vocab_size:
        raise ValueError(
            f"reward {reward!r}: the tokenizer has {len(tok)} tokens (with BLIP's [DEC] and [ENC]) but the text "
            f"encoder's embedding table has {text_config.vocab_size}: use the vocab.txt of {BERT_REPO}"
        )
    model = ImageRewardModel(vision_config, text_config, head)
    model.vision.load_state_dict(parts["vision"], strict=True)
    model.text.load_state_dict(parts["text"], strict=True)
    return model.eval().requires_grad_(False), tok


@register(
    "imagereward",
    description=(
        "ImageReward (BLIP ViT-L + cross-attending BERT + MLP), normalised score, differentiable "
        f"(needs: {CHECKPOINT_FILE} from {IMAGEREWARD_REPO} + vocab.txt of {BERT_REPO})"
    ),
)
class ImageReward(Reward):
    """ImageReward human-preference score on transformers' BLIP classes (normalised: about N(0, 1) on its data).

    Args:
        checkpoint (`str`, defaults to `"THUDM/ImageReward"`): `ImageReward.pt`, a folder holding it, or a hub id.
        tokenizer (`str`, defaults to `"google-bert/bert-base-uncased"`): folder with `vocab.txt` (or hub id).
        max_length (`int`, defaults to 35): prompt length in tokens, as the official scorer.
        enc_token (`bool`, defaults to `False`): replace the first token (`[CLS]`) with BLIP's `[ENC]`.
        device, dtype, batch_size: see `Reward`.
    """

    differentiable = True

    def __init__(
        self,
        checkpoint: str = IMAGEREWARD_REPO,
        tokenizer: str = BERT_REPO,
        max_length: int = 35,
        enc_token: bool = False,
        device=None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 16,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        model, self.tokenizer = load_imagereward(checkpoint, tokenizer, reward=self.name)
        model.vision.to(self.device, self.dtype)
        model.text.to(self.device, self.dtype)
        self.model = model.to(self.device)
        self.max_length = max_length
        self.enc_token = enc_token
        self.image_settings = ImageSettings.square(model.vision.config.image_size)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask)` `[B, max_length]` as the official scorer builds them."""
        tokens = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        ids = tokens.input_ids
        if self.enc_token:
            ids[:, 0] = self.tokenizer.convert_tokens_to_ids("[ENC]")
        return ids.to(self.device), tokens.attention_mask.to(self.device)

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        pixels = self.image_settings(images.to(self.device)).to(self.dtype)
        ids, mask = self.tokenize(prompts)
        return self.model(pixels, ids, mask)
