"""`open_clip` models (an optional extra: `pip install flowrl-toolkit[openclip]`, GPU machines) for CLIP scores of
any open_clip architecture or tag (HPSv2 runs its open_clip weights through transformers: `openclip_to_hf`).

open_clip needs torchvision, and on CPU-only installs the only torchvision that matches torch is a CUDA build
that breaks transformers; so open_clip is imported only when a reward that needs it is constructed, and its
absence raises one clear `ImportError` naming the extra.
"""

from __future__ import annotations

import torch

from flowrl.rewards.clip_models import CLIPBackend, TextCache, unit_norm
from flowrl.rewards.loading import hub_state
from flowrl.rewards.preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageSettings


def require_open_clip(reward: str):
    """The `open_clip` module, or an `ImportError` that says how to install it."""
    try:
        import open_clip
    except ImportError as err:
        raise ImportError(
            f"reward {reward!r} needs open_clip, which is not installed ({err}). Install the extra with "
            "`pip install flowrl-toolkit[openclip]` on a machine with a CUDA torch (it pulls torchvision, whose only "
            "build for CPU torch breaks transformers)."
        ) from err
    return open_clip


class OpenCLIP(CLIPBackend):
    """An open_clip CLIP model with its tokenizer and image preprocessing.

    Args:
        reward (`str`): the reward's name, for error messages.
        arch (`str`): open_clip model name (`ViT-H-14`, `ViT-L-14-quickgelu`, ...).
        pretrained (`str`, *optional*): an open_clip pretrained tag (downloaded through the hub cache) or a
            local checkpoint file; `None` builds random weights (to be replaced with `load_state_dict`).
    """

    def __init__(self, reward: str, arch: str, pretrained: str | None = None, *, device=None, dtype=torch.float32):
        super().__init__()
        open_clip = require_open_clip(reward)
        try:
            model = open_clip.create_model(arch, pretrained=pretrained)
        except RuntimeError as err:  # open_clip raises RuntimeError for unknown tags and failed downloads
            from flowrl.rewards import RewardWeightsError

            raise RewardWeightsError(
                f"reward {reward!r}: cannot load open_clip {arch!r} weights {pretrained!r}: {hub_state()} or the tag "
                f"is unknown ({err}). Pass pretrained=PATH to a local open_clip checkpoint file instead."
            ) from err
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(arch)
        size = model.visual.image_size
        size = size if isinstance(size, int) else int(size[0])
        mean = getattr(model.visual, "image_mean", None) or OPENAI_CLIP_MEAN
        std = getattr(model.visual, "image_std", None) or OPENAI_CLIP_STD
        self.image_settings = ImageSettings.square(size, mean, std)
        self.text = TextCache(self._encode_text)
        self.to(device=device, dtype=dtype)

    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(prompts).to(self.device)
        return unit_norm(self.model.encode_text(tokens))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """`[B, D]` unit-norm image embeddings of `[B, 3, H, W]` images in [0, 1] (differentiable)."""
        pixels = self.image_settings(images.to(self.device)).to(self.model.logit_scale.dtype)
        return unit_norm(self.model.encode_image(pixels))
