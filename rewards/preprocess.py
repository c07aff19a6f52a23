"""Differentiable image preprocessing for CLIP/BLIP-style reward models, in torch ops only.

The released reward models preprocess PIL images: resize the shortest side to the model's resolution with
bicubic filtering, centre-crop, scale to [0, 1], normalise with the model's mean and std. `ImageSettings` does
the same on `[B, 3, H, W]` tensors in [0, 1] with `torch.nn.functional.interpolate(mode="bicubic",
antialias=True)`, so gradients reach the pixels and nothing leaves the device. Differences from the PIL path:
no uint8 quantisation, and torch's antialiased bicubic kernel instead of PIL's (they agree to about 1e-2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


# OpenAI CLIP normalisation; also used by PickScore (CLIP-H), HPSv2 (open_clip ViT-H-14) and BLIP/ImageReward.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def resize_shortest_side(images: torch.Tensor, size: int, *, antialias: bool = True) -> torch.Tensor:
    """Bicubic resize of `[B, C, H, W]` so that min(H, W) == size, keeping the aspect ratio.

    The long side becomes `int(size * long / short)`, as torchvision's `Resize(int)` and transformers'
    `shortest_edge` do.
    """
    h, w = images.shape[-2:]
    if min(h, w) == size:
        return images
    if h <= w:
        new_h, new_w = size, int(size * w / h)
    else:
        new_h, new_w = int(size * h / w), size
    return F.interpolate(images, size=(new_h, new_w), mode="bicubic", antialias=antialias, align_corners=False)


def center_crop(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The central `height x width` window (offsets rounded as torchvision's `CenterCrop`)."""
    h, w = images.shape[-2:]
    if h < height or w < width:
        raise ValueError(f"cannot centre-crop {h}x{w} images to {height}x{width}")
    top = int(round((h - height) / 2.0))
    left = int(round((w - width) / 2.0))
    return images[..., top : top + height, left : left + width]


def _size(value: Any, default: int) -> tuple[int, int] | int:
    """A processor-config size: int, {"shortest_edge": n} or {"height": h, "width": w}."""
    if value is None:
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        if "shortest_edge" in value:
            return int(value["shortest_edge"])
        if "height" in value and "width" in value:
            return int(value["height"]), int(value["width"])
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    raise ValueError(f"unsupported image size setting {value!r}")


@dataclass(frozen=True)
class ImageSettings:
    """Resize-crop-normalise settings of one image encoder, applied by calling the instance.

    Args:
        size (`int`): the shortest side after resizing.
        crop (`tuple[int, int]`): `(height, width)` of the centre crop.
        mean, std (`tuple[float, float, float]`): per-channel normalisation.
    """

    size: int = 224
    crop: tuple[int, int] = (224, 224)
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def square(cls, size: int, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD) -> ImageSettings:
        """Resize the shortest side to `size`, crop `size x size` (CLIP's and BLIP's evaluation transform)."""
        return cls(size=int(size), crop=(int(size), int(size)), mean=tuple(mean), std=tuple(std))

    @classmethod
    def from_processor_config(cls, config: dict[str, Any], default_size: int) -> ImageSettings:
        """Settings from a transformers `preprocessor_config.json` dict (CLIPImageProcessor keys)."""
        size = _size(config.get("size"), default_size) if config.get("do_resize", True) else default_size
        crop = _size(config.get("crop_size"), default_size) if config.get("do_center_crop", True) else size
        if isinstance(size, tuple):  # a fixed (h, w) resize: crop to it as well
            crop, size = size, min(size)
        crop = crop if isinstance(crop, tuple) else (crop, crop)
        mean = tuple(config.get("image_mean", OPENAI_CLIP_MEAN))
        std = tuple(config.get("image_std", OPENAI_CLIP_STD))
        return cls(size=int(size), crop=(int(crop[0]), int(crop[1])), mean=mean, std=std)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """`[B, 3, H, W]` in [0, 1] -> normalised `[B, 3, crop_h, crop_w]` in fp32 (cast to the model dtype after)."""
        x = images.float()
        x = resize_shortest_side(x, self.size)
        x = center_crop(x, *self.crop)
        x = x.clamp(0.0, 1.0)  # bicubic overshoots; PIL clips to uint8 range, so clip here too
        mean = torch.tensor(self.mean, device=x.device, dtype=x.dtype)[:, None, None]
        std = torch.tensor(self.std, device=x.device, dtype=x.dtype)[:, None, None]
        return (x - mean) / std


def read_processor_config(location: str | os.PathLike | None) -> dict[str, Any] | None:
    """`preprocessor_config.json` of a local folder or a cached hub repo; `None` when it is not available."""
    if location is None:
        return None
    path = Path(location).expanduser()
    if path.is_dir():
        file = path / "preprocessor_config.json"
        return json.loads(file.read_text()) if file.is_file() else None
    if path.exists():
        return None
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(str(location), "preprocessor_config.json")).read_text())
    except Exception:  # not cached / offline / no such file: fall back to the model's defaults
        return None
