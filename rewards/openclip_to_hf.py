"""open_clip ViT checkpoints as transformers `CLIPModel`s, so the rewards trained on them need neither open_clip nor
torchvision (HPSv2 runs on any machine, CPU-only installs included).

open_clip's `CLIP` (Radford et al. 2021, arXiv:2103.00020, as built by `open_clip.model.CLIP` with a
`VisionTransformer` and a `TextTransformer`) and transformers' `CLIPModel` compute the same function with other
names: pre-LayerNorm blocks (eps 1e-5), a fused `in_proj` for q, k and v where transformers keeps three
projections, the class token through `ln_post` and `proj` for the image, the first end-of-text token (open_clip's
`text.argmax(-1)`: end-of-text is the vocabulary's largest id) through `ln_final` and `text_projection` for the
text, under a causal mask. The widths, depths, patch, image and context sizes are read from the checkpoint's
shapes; the head counts and the activation are not in a state dict, so they come from `OPEN_CLIP_ARCHS` (the
values of open_clip's `model_configs/*.json`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OpenCLIPArch:
    """What an open_clip ViT architecture holds beyond its checkpoint's shapes."""

    vision_head_width: int = 64
    """Width of one vision attention head (`vision_cfg.head_width` in open_clip's config; heads = width / it)."""
    text_head_width: int = 64
    """Width of one text attention head (open_clip's `text_cfg.width / text_cfg.heads`)."""
    hidden_act: str = "gelu"
    """The MLP activation: `gelu` (exact, open_clip's default) or `quick_gelu` (OpenAI's, the `-quickgelu` models)."""


OPEN_CLIP_ARCHS: dict[str, OpenCLIPArch] = {
    "ViT-H-14": OpenCLIPArch(vision_head_width=80),  # HPS v2 / v2.1, PickScore's base, laion2B-s32B-b79K
    "ViT-L-14": OpenCLIPArch(),
    "ViT-L-14-quickgelu": OpenCLIPArch(hidden_act="quick_gelu"),
    "ViT-B-16": OpenCLIPArch(),
    "ViT-B-32": OpenCLIPArch(),
}
"""The open_clip architectures whose checkpoints convert, by open_clip's name."""

_BLOCK = {  # one residual block's open_clip modules -> transformers' (in_proj is split apart)
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_NORMS = {  # the LayerNorms outside the blocks
    "visual.ln_pre": "vision_model.pre_layrnorm",
    "visual.ln_post": "vision_model.post_layernorm",
    "ln_final": "text_model.final_layer_norm",
}
_TENSORS = {  # open_clip tensor -> (transformers name, transposed)
    "visual.conv1.weight": ("vision_model.embeddings.patch_embedding.weight", False),
    "visual.class_embedding": ("vision_model.embeddings.class_embedding", False),
    "visual.positional_embedding": ("vision_model.embeddings.position_embedding.weight", False),
    "visual.proj": ("visual_projection.weight", True),  # x @ proj == Linear with weight proj^T
    "token_embedding.weight": ("text_model.embeddings.token_embedding.weight", False),
    "positional_embedding": ("text_model.embeddings.position_embedding.weight", False),
    "text_projection": ("text_projection.weight", True),
    "logit_scale": ("logit_scale", False),
}
# the causal mask, a buffer some checkpoints saved; transformers builds its own
_IGNORED = {"attn_mask", "visual.attn_mask"}
_SHAPED = (  # the weights whose shapes give the config
    "visual.conv1.weight",
    "visual.positional_embedding",
    "visual.proj",
    "visual.transformer.resblocks.0.mlp.c_fc.weight",
    "token_embedding.weight",
    "positional_embedding",
    "text_projection",
    "transformer.resblocks.0.mlp.c_fc.weight",
)
_BLOCK_KEY = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$")


def convert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers `CLIPModel` names for an open_clip ViT state dict (no prefix), or a `ValueError` naming the keys
    it cannot place (a ResNet or timm tower, layer scale, attention pooling: architectures this does not cover)."""
    out, unknown = {}, []
    for key, value in state.items():
        module, _, kind = key.rpartition(".")
        match = _BLOCK_KEY.match(key)
        if key in _TENSORS:
            name, transposed = _TENSORS[key]
            out[name] = value.t().contiguous() if transposed else value
        elif module in _NORMS:
            out[f"{_NORMS[module]}.{kind}"] = value
        elif key in _IGNORED:
            continue
        elif match is None:
            unknown.append(key)
        else:
            tower = "vision_model" if match.group(1) else "text_model"
            prefix, rest = f"{tower}.encoder.layers.{match.group(2)}.", match.group(3)
            inner = rest.rpartition(".")[0]  # the module inside the block
            if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
                kind = rest.rsplit("_", 1)[1]  # weight [3W, W] / bias [3W]: q, k, v stacked in that order
                for part, chunk in zip("qkv", value.chunk(3, dim=0)):
                    out[f"{prefix}self_attn.{part}_proj.{kind}"] = chunk
            elif inner in _BLOCK:
                out[f"{prefix}{_BLOCK[inner]}.{kind}"] = value
            else:
                unknown.append(key)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ValueError(f"not an open_clip ViT checkpoint this converts: it has keys {shown}")
    return out


def _layers(state: dict[str, torch.Tensor], tower: str) -> int:
    """The block count of the tower whose keys start with `tower` (`"visual."` or `""`)."""
    return 1 + max(int(m.group(2)) for k in state if (m := _BLOCK_KEY.match(k)) and (m.group(1) or "") == tower)


def clip_config(state: dict[str, torch.Tensor], arch: OpenCLIPArch):
    """The transformers `CLIPConfig` of an open_clip ViT state dict (shapes from the weights, heads from `arch`)."""
    from transformers import CLIPConfig

    missing = [k for k in _SHAPED if k not in state]
    if missing:
        raise ValueError(f"not an open_clip ViT checkpoint: it has no {', '.join(missing)}")
    patch = state["visual.conv1.weight"]  # [W, 3, P, P]
    vision_width, patch_size = int(patch.shape[0]), int(patch.shape[-1])
    grid = math.isqrt(int(state["visual.positional_embedding"].shape[0]) - 1)  # class token + grid^2 patches
    vocab_size, text_width = (int(n) for n in state["token_embedding.weight"].shape)
    for width, head in ((vision_width, arch.vision_head_width), (text_width, arch.text_head_width)):
        if width % head:
            raise ValueError(f"a tower of width {width} does not split into heads of width {head}: another arch?")
    vision = dict(
        hidden_size=vision_width,
        intermediate_size=int(state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
        num_attention_heads=vision_width // arch.vision_head_width,
        num_hidden_layers=_layers(state, "visual."),
        image_size=grid * patch_size,
        patch_size=patch_size,
        hidden_act=arch.hidden_act,
        layer_norm_eps=1e-5,
    )
    text = dict(
        vocab_size=vocab_size,
        hidden_size=text_width,
        intermediate_size=int(state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
        num_attention_heads=text_width // arch.text_head_width,
        num_hidden_layers=_layers(state, ""),
        max_position_embeddings=int(state["positional_embedding"].shape[0]),
        hidden_act=arch.hidden_act,
        layer_norm_eps=1e-5,
        # open_clip's tokenizer appends <start_of_text>, <end_of_text> last: pooling at the first end-of-text id is
        # its argmax pooling
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=0,
    )
    projection_dim = int(state["visual.proj"].shape[1])
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)


def open_clip_to_clip(state: dict[str, torch.Tensor], arch: OpenCLIPArch):
    """A transformers `CLIPModel` computing what open_clip computes with `state` (strict: every weight placed)."""
    from transformers import CLIPModel

    config = clip_config(state, arch)
    converted = convert_state(state)
    with torch.device("meta"):
        expected = CLIPModel(config).state_dict()
    missing = sorted(set(expected) - set(converted))
    wrong = [k for k in expected if k in converted and tuple(converted[k].shape) != tuple(expected[k].shape)]
    if missing or wrong:
        raise ValueError(
            f"the open_clip checkpoint does not fill a CLIPModel: missing {missing[:5]}, wrong shape {wrong[:5]}"
        )
    return CLIPModel.from_pretrained(None, config=config, state_dict=converted)
