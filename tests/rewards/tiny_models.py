"""Tiny random reward models of the real architectures, written to disk in the layouts the loaders read.

- `save_tiny_clip(dir)`: a transformers `CLIPModel` (+ byte-level CLIP tokenizer + preprocessor_config.json).
- `aesthetic_head_state(d_in)`: the released MLP head layout `layers.{0,2,4,6,7}.*`.
- `imagereward_official_state()`: an ImageReward checkpoint in the official key layout, written key by key
  from BLIP's timm ViT (`blip.visual_encoder.*`) and `med.BertModel` (`blip.text_encoder.*`) naming, so the
  key mapper is checked against the original names rather than against its own inverse.
- `write_bert_vocab(dir, size)`: a WordPiece `vocab.txt` with BERT's special tokens at BERT's ids.
- `tiny_open_clip_state(vocab_size)`: an open_clip ViT CLIP state dict in open_clip's own names (fused `in_proj`,
  `c_fc`/`c_proj`, `proj` as a matrix), written from `open_clip.model.CLIP`'s layout, not from the converter's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F


CLIP_PROJECTION = 16
CLIP_IMAGE = 32


def save_tiny_clip(folder: Path, seed: int = 0, image_size: int = CLIP_IMAGE, vocab_size: int | None = None) -> Path:
    from transformers import CLIPConfig, CLIPModel

    from flowrl.models.tiny import tiny_clip_tokenizer

    tok = tiny_clip_tokenizer()
    text = dict(
        vocab_size=vocab_size or len(tok),
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=77,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        image_size=image_size,
        patch_size=8,
    )
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=CLIP_PROJECTION))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    processor = {
        "do_resize": True,
        "size": {"shortest_edge": image_size},
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return folder


def aesthetic_head_state(d_in: int = CLIP_PROJECTION, seed: int = 0) -> dict[str, torch.Tensor]:
    """The released head's layout: Linear at Sequential indices 0, 2, 4, 6, 7 (Dropout in between)."""
    g = torch.Generator().manual_seed(seed)
    dims = [d_in, 24, 12, 8, 4, 1]
    state = {}
    for k, index in enumerate([0, 2, 4, 6, 7]):
        state[f"layers.{index}.weight"] = torch.randn(dims[k + 1], dims[k], generator=g) / dims[k] ** 0.5
        state[f"layers.{index}.bias"] = torch.randn(dims[k + 1], generator=g) * 0.1
    return state


# ImageReward: vision width 128 (2 heads of 64), patch 8 at 32 px; text width 64 (1 head), BLIP's 30524 tokens.
VISION = dict(width=128, layers=2, mlp=96, patch=8, image=32)
TEXT = dict(width=64, layers=2, mlp=96, vocab=30524, positions=40)


def _param(g, *shape, scale=0.02):
    return torch.randn(*shape, generator=g) * scale


def _norm(g, prefix, width, state):
    state[prefix + ".weight"] = 1 + _param(g, width, scale=0.1)
    state[prefix + ".bias"] = _param(g, width)


def _linear(g, prefix, d_out, d_in, state):
    state[prefix + ".weight"] = _param(g, d_out, d_in, scale=d_in**-0.5)
    state[prefix + ".bias"] = _param(g, d_out)


def imagereward_official_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random ImageReward checkpoint with every key of the official `ImageReward.pt` layout."""
    g = torch.Generator().manual_seed(seed)
    s: dict[str, torch.Tensor] = {}
    d, p = VISION["width"], VISION["patch"]
    n = (VISION["image"] // p) ** 2
    v = "blip.visual_encoder."
    s[v + "cls_token"] = _param(g, 1, 1, d)
    s[v + "pos_embed"] = _param(g, 1, n + 1, d)
    s[v + "patch_embed.proj.weight"] = _param(g, d, 3, p, p, scale=(3 * p * p) ** -0.5)
    s[v + "patch_embed.proj.bias"] = _param(g, d)
    for i in range(VISION["layers"]):
        b = f"{v}blocks.{i}."
        _norm(g, b + "norm1", d, s)
        _linear(g, b + "attn.qkv", 3 * d, d, s)
        _linear(g, b + "attn.proj", d, d, s)
        _norm(g, b + "norm2", d, s)
        _linear(g, b + "mlp.fc1", VISION["mlp"], d, s)
        _linear(g, b + "mlp.fc2", d, VISION["mlp"], s)
    _norm(g, v + "norm", d, s)
    h, t = TEXT["width"], "blip.text_encoder."
    s[t + "embeddings.word_embeddings.weight"] = _param(g, TEXT["vocab"], h)
    s[t + "embeddings.position_embeddings.weight"] = _param(g, TEXT["positions"], h)
    s[t + "embeddings.position_ids"] = torch.arange(TEXT["positions"])[None]  # a persistent buffer in BLIP's med
    _norm(g, t + "embeddings.LayerNorm", h, s)
    for i in range(TEXT["layers"]):
        b = f"{t}encoder.layer.{i}."
        for block, kv_width in (("attention", h), ("crossattention", d)):
            _linear(g, f"{b}{block}.self.query", h, h, s)
            _linear(g, f"{b}{block}.self.key", h, kv_width, s)
            _linear(g, f"{b}{block}.self.value", h, kv_width, s)
            _linear(g, f"{b}{block}.output.dense", h, h, s)
            _norm(g, f"{b}{block}.output.LayerNorm", h, s)
        _linear(g, b + "intermediate.dense", TEXT["mlp"], h, s)
        _linear(g, b + "output.dense", h, TEXT["mlp"], s)
        _norm(g, b + "output.LayerNorm", h, s)
    _linear(g, "blip.vision_proj", 256, d, s)  # BLIP's contrastive projections: in the file, unused for scoring
    _linear(g, "blip.text_proj", 256, h, s)
    for k, v_ in aesthetic_head_state(h, seed).items():
        s["mlp." + k] = v_
    return s


def reference_vit(state: dict[str, torch.Tensor], pixels: torch.Tensor, head_dim: int = 64) -> torch.Tensor:
    """BLIP's timm ViT forward written from its definition, reading the official key names."""
    v = "blip.visual_encoder."
    d = state[v + "cls_token"].shape[-1]
    heads = d // head_dim
    x = F.conv2d(
        pixels, state[v + "patch_embed.proj.weight"], state[v + "patch_embed.proj.bias"], stride=VISION["patch"]
    )
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([state[v + "cls_token"].expand(len(x), -1, -1), x], 1) + state[v + "pos_embed"]
    b, n, _ = x.shape
    for i in range(VISION["layers"]):
        p = f"{v}blocks.{i}."
        h = F.layer_norm(x, (d,), state[p + "norm1.weight"], state[p + "norm1.bias"], eps=1e-6)
        qkv = F.linear(h, state[p + "attn.qkv.weight"], state[p + "attn.qkv.bias"])
        q, k, val = qkv.reshape(b, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * head_dim**-0.5).softmax(-1)
        out = (attn @ val).transpose(1, 2).reshape(b, n, d)
        x = x + F.linear(out, state[p + "attn.proj.weight"], state[p + "attn.proj.bias"])
        h = F.layer_norm(x, (d,), state[p + "norm2.weight"], state[p + "norm2.bias"], eps=1e-6)
        h = F.linear(
            F.gelu(F.linear(h, state[p + "mlp.fc1.weight"], state[p + "mlp.fc1.bias"])), *_wb(state, p + "mlp.fc2")
        )
        x = x + h
    return F.layer_norm(x, (d,), state[v + "norm.weight"], state[v + "norm.bias"], eps=1e-6)


def _wb(state, prefix):
    return state[prefix + ".weight"], state[prefix + ".bias"]


def reference_head(state: dict[str, torch.Tensor], features: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """The released MLP head as five affine maps (no activations)."""
    x = features
    for index in (0, 2, 4, 6, 7):
        x = F.linear(x, *_wb(state, f"{prefix}layers.{index}"))
    return x[:, 0]


WORDS = "a an the photo of cat dog red blue green sign that says hello world on in with two three small big".split()


def write_bert_vocab(folder: Path, size: int = 30522) -> Path:
    """`vocab.txt` with BERT's special ids ([PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103), some words,
    single letters and `##` pieces, padded with unused tokens to `size` entries."""
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = (
        WORDS + list("abcdefghijklmnopqrstuvwxyz0123456789\"'.,!?") + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    )
    tokens += list(dict.fromkeys(pieces))  # unique, in order: ids must be dense
    tokens += [f"[unused{i}]" for i in range(99, 99 + size - len(tokens))]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(tokens[:size]) + "\n")
    return folder


def tiny_open_clip_state(
    vocab_size: int,
    seed: int = 0,
    context: int = 16,
    *,
    widths: tuple[int, int] = (64, 64),
    layers: tuple[int, int] = (2, 2),
    patch: int = 8,
    grid: int = 4,
    embed: int = CLIP_PROJECTION,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Random weights in open_clip's `CLIP` layout: by default a ViT of 2 blocks over 32 px / 8 px patches and a
    text tower of 2 blocks over `context` tokens, both 64 wide (`widths`: vision, text), MLPs 4x wide, a 16-wide
    joint space; on `device="meta"`, the shapes of any size."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        if device == "meta":
            return torch.empty(*shape, device="meta")
        return torch.randn(*shape, generator=g) * scale

    def norm(prefix, w):  # LayerNorm weights away from (1, 0), so a swapped or missing one shows
        return {f"{prefix}.weight": 1 + rand(w), f"{prefix}.bias": rand(w)}

    def blocks(prefix, w, depth):
        out = {}
        for i in range(depth):
            b = f"{prefix}transformer.resblocks.{i}."
            out |= norm(b + "ln_1", w) | norm(b + "ln_2", w)
            out |= {b + "attn.in_proj_weight": rand(3 * w, w), b + "attn.in_proj_bias": rand(3 * w)}
            out |= {b + "attn.out_proj.weight": rand(w, w), b + "attn.out_proj.bias": rand(w)}
            out |= {b + "mlp.c_fc.weight": rand(4 * w, w), b + "mlp.c_fc.bias": rand(4 * w)}
            out |= {b + "mlp.c_proj.weight": rand(w, 4 * w), b + "mlp.c_proj.bias": rand(w)}
        return out

    v, t = widths
    state = {"visual.conv1.weight": rand(v, 3, patch, patch), "visual.class_embedding": rand(v, scale=1.0)}
    state |= {"visual.positional_embedding": rand(1 + grid * grid, v, scale=1.0)}
    state |= norm("visual.ln_pre", v) | blocks("visual.", v, layers[0]) | norm("visual.ln_post", v)
    state |= {"visual.proj": rand(v, embed, scale=1.0)}
    state |= {"token_embedding.weight": rand(vocab_size, t, scale=1.0), "positional_embedding": rand(context, t)}
    state |= blocks("", t, layers[1]) | norm("ln_final", t) | {"text_projection": rand(t, embed, scale=1.0)}
    return state | {"logit_scale": torch.tensor(4.6052, device=device)}
