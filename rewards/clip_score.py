"""CLIP text-image similarity (CLIPScore, Hessel et al. 2021, arXiv:2104.08718).

`cos = <E_img(x), E_txt(c)>` with unit-norm embeddings. Scales (`scale=`):

- `"cosine"` (default): `cos`, in [-1, 1] (typically 0.15-0.40 for matching pairs with CLIP ViT-L/14).
- `"clipscore"`: `2.5 * max(cos, 0)`, Hessel et al.'s CLIPScore (zero gradient where cos < 0).
- `"flow_grpo"`: `exp(logit_scale) * cos / 30` = `100 cos / 30` for OpenAI CLIP, Flow-GRPO's `ClipScorer`.

Backends: transformers' `CLIPModel` (default, `model` is a hub id or folder) or open_clip
(`backend="open_clip"`, `model` is an open_clip architecture, `pretrained` a tag or checkpoint file; needs
the `openclip` extra). Differentiable.
"""

from __future__ import annotations

import torch

from flowrl.rewards import register
from flowrl.rewards.base import Reward


CLIP_REPO = "openai/clip-vit-large-patch14"
SCALES = ("cosine", "clipscore", "flow_grpo")


@register(
    "clip_score",
    description=(
        "CLIP text-image cosine similarity (scale: cosine | clipscore 2.5*max(cos,0) | flow_grpo), differentiable "
        f"(needs: {CLIP_REPO}, or open_clip weights with backend=open_clip)"
    ),
)
class ClipScore(Reward):
    """CLIP text-image cosine similarity of each image with its prompt.

    Args:
        model (`str`, defaults to `"openai/clip-vit-large-patch14"`): transformers backend: hub id or local folder
            of a `CLIPModel` (with its tokenizer); open_clip backend: the architecture name
            (e.g. `"ViT-L-14-quickgelu"`).
        scale (`str`, defaults to `"cosine"`): `"cosine"`, `"clipscore"` (`2.5 * max(cos, 0)`) or `"flow_grpo"`
            (`exp(logit_scale) * cos / 30`).
        backend (`str`, defaults to `"transformers"`): `"transformers"` or `"open_clip"`.
        pretrained (`str`, *optional*): open_clip backend only: pretrained tag (`"openai"`) or checkpoint path.
        processor (`str`, *optional*): transformers backend: folder/hub id of the tokenizer and
            `preprocessor_config.json` when they are not next to the weights.
        device, dtype, batch_size: see `Reward`.
    """

    differentiable = True

    def __init__(
        self,
        model: str = CLIP_REPO,
        scale: str = "cosine",
        backend: str = "transformers",
        pretrained: str | None = None,
        processor: str | None = None,
        device=None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if scale not in SCALES:
            raise ValueError(f"reward 'clip_score': scale must be one of {SCALES}, got {scale!r}")
        self.scale = scale
        if backend == "transformers":
            from flowrl.rewards.clip_models import HFCLIP

            self.clip = HFCLIP(
                self.name, model, processor, default_repo=CLIP_REPO, device=self.device, dtype=self.dtype
            )
        elif backend == "open_clip":
            from flowrl.rewards.openclip import OpenCLIP

            model = "ViT-L-14-quickgelu" if model == CLIP_REPO else model
            self.clip = OpenCLIP(self.name, model, pretrained or "openai", device=self.device, dtype=self.dtype)
        else:
            raise ValueError(f"reward 'clip_score': backend must be 'transformers' or 'open_clip', got {backend!r}")

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        cos = (self.clip.encode_image(images) * self.clip.encode_text(prompts)).sum(-1)
        if self.scale == "clipscore":
            return 2.5 * cos.clamp_min(0.0)
        if self.scale == "flow_grpo":
            return self.clip.logit_scale * cos / 30.0
        return cos
