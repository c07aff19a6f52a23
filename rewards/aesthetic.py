"""LAION aesthetic predictor v2 (christophschuhmann/improved-aesthetic-predictor), as used by DDPO and Flow-GRPO.

`r = MLP(e / ||e||)`, `e` = the CLIP ViT-L/14 image embedding (projection output, 768-d) and MLP the released
linear head 768 -> 1024 -> 128 -> 64 -> 16 -> 1 (`sac+logos+ava1-l14-linearMSE.pth`, trained with MSE on
SAC + LAION-Logos + AVA ratings). The score is on the raters' 1-10 scale (typical images 4-7). Differentiable.
"""

from __future__ import annotations

import torch

from flowrl.rewards import register
from flowrl.rewards.base import Reward
from flowrl.rewards.clip_models import load_clip_model, unit_norm
from flowrl.rewards.heads import MLPHead, strip_prefix
from flowrl.rewards.loading import load_state_dict, resolve_file
from flowrl.rewards.preprocess import ImageSettings, read_processor_config


CLIP_REPO = "openai/clip-vit-large-patch14"
HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"
HEAD_URL = (
    "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac+logos+ava1-l14-linearMSE.pth"
)


@register(
    "aesthetic",
    description=(
        f"LAION aesthetic predictor v2 on CLIP ViT-L/14, 1-10 scale, differentiable (needs: {CLIP_REPO} + {HEAD_FILE})"
    ),
)
class AestheticReward(Reward):
    """LAION aesthetic score: a linear MLP on the normalised CLIP ViT-L/14 image embedding (1-10 scale).

    Args:
        model (`str`, defaults to `"openai/clip-vit-large-patch14"`): hub id or local folder of the CLIP model.
        head (`str`): the head weights: `sac+logos+ava1-l14-linearMSE.pth` (a torch state dict, loaded with
            `weights_only=True`) or a `.safetensors` conversion, or a folder holding one of them. Download:
            https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac+logos+ava1-l14-linearMSE.pth
        device, dtype, batch_size: see `Reward`.
    """

    differentiable = True

    def __init__(
        self,
        model: str = CLIP_REPO,
        head: str | None = None,
        device=None,
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        config = "`rewards: [{name: aesthetic, kwargs: {head: PATH}}]`"
        head_fix = f"download {HEAD_URL} and pass head=PATH (config: {config})"
        head_path = resolve_file(
            self.name,
            head,
            [HEAD_FILE, HEAD_FILE.replace(".pth", ".safetensors")],
            what="aesthetic MLP head",
            fix=head_fix,
        )
        state = strip_prefix(load_state_dict(self.name, head_path), ("module.", "mlp.", "model."))
        self.head = MLPHead.from_state_dict(state, what=f"reward 'aesthetic' head {str(head_path)!r}")
        clip = load_clip_model(self.name, model, default_repo=CLIP_REPO)
        if self.head.in_features != clip.config.projection_dim:
            raise ValueError(
                f"reward 'aesthetic': the head takes {self.head.in_features}-d embeddings but the CLIP model "
                f"{model!r} projects to {clip.config.projection_dim} (the released head needs ViT-L/14, 768-d)"
            )
        # Only the vision tower is needed; the text tower is dropped with `clip`.
        self.vision = clip.vision_model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.projection = clip.visual_projection.to(self.device, self.dtype).eval().requires_grad_(False)
        self.head = self.head.to(self.device, torch.float32).eval().requires_grad_(False)
        config = read_processor_config(model)
        size = int(clip.config.vision_config.image_size)
        self.image_settings = (
            ImageSettings.from_processor_config(config, size) if config else ImageSettings.square(size)
        )

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Unit-norm CLIP image embeddings `[B, 768]` (fp32, differentiable)."""
        pixels = self.image_settings(images.to(self.device)).to(self.dtype)
        return unit_norm(self.projection(self.vision(pixel_values=pixels).pooler_output))

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        return self.head(self.embed(images))[:, 0]
