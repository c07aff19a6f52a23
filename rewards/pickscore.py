"""PickScore (Kirstain et al. 2023, arXiv:2305.01569): CLIP-H fine-tuned on Pick-a-Pic human preferences.

`r = exp(logit_scale) * cos(E_txt(c), E_img(x)) / divisor`. The raw PickScore (`divisor=1`) is around 18-24 for
SD-quality images (logit scale exp = 100); Flow-GRPO divides by 26 to land roughly in [0, 1], which is the
default here. Weights: `yuvalkirstain/PickScore_v1` (a transformers `CLIPModel`, ViT-H/14); tokenizer and
image processor: `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`. Differentiable.
"""

from __future__ import annotations

import torch

from flowrl.rewards import register
from flowrl.rewards.base import Reward


PICKSCORE_REPO = "yuvalkirstain/PickScore_v1"
PROCESSOR_REPO = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


@register(
    "pickscore",
    description=(
        "PickScore: exp(logit_scale)*cos(text, image)/26 (Flow-GRPO scale, about [0, 1]), differentiable "
        f"(needs: {PICKSCORE_REPO} + tokenizer/processor of {PROCESSOR_REPO})"
    ),
)
class PickScore(Reward):
    """PickScore human-preference reward, divided by 26 by default as in Flow-GRPO.

    Args:
        model (`str`, defaults to `"yuvalkirstain/PickScore_v1"`): hub id or local folder of the weights.
        processor (`str`, defaults to `"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"`): hub id or local folder of the
            tokenizer and `preprocessor_config.json`. `None` uses `model` (a folder holding both).
        divisor (`float`, defaults to 26.0): the score is divided by it; 1.0 gives the raw PickScore.
        device, dtype, batch_size: see `Reward`.
    """

    differentiable = True

    def __init__(
        self,
        model: str = PICKSCORE_REPO,
        processor: str | None = PROCESSOR_REPO,
        divisor: float = 26.0,
        device=None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        from flowrl.rewards.clip_models import HFCLIP

        if divisor <= 0:
            raise ValueError(f"reward 'pickscore': divisor must be positive, got {divisor}")
        self.divisor = float(divisor)
        self.clip = HFCLIP(
            self.name,
            model,
            processor,
            default_repo=PICKSCORE_REPO,
            default_processor=PROCESSOR_REPO,
            device=self.device,
            dtype=self.dtype,
        )

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        cos = (self.clip.encode_image(images) * self.clip.encode_text(prompts)).sum(-1)
        return self.clip.logit_scale * cos / self.divisor
