"""JPEG (in)compressibility: the file size of the image saved as a JPEG (DDPO, Black et al. 2023, arXiv:2305.13301).

`size_kb = len(JPEG(uint8(round(255 * image)), quality=95)) / 1000`; compressibility rewards `-size_kb`,
incompressibility `+size_kb` (ddpo-pytorch `rewards.py`). No weights; not differentiable (PIL encodes on the CPU).
"""

from __future__ import annotations

import io

import torch

from flowrl.rewards import register
from flowrl.rewards.base import Reward


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """Size in kB (1000 bytes) of each `[3, H, W]` image in [0, 1] encoded by PIL as JPEG at `quality`."""
    from PIL import Image

    sizes = []
    for image in images.detach():  # PIL encodes one image at a time; converted one at a time (a batch's float
        # temporaries would be 3x the batch's own size: the reward server charges a request's pixels, not those)
        pixels = (image.float().clamp(0, 1) * 255).round().to(torch.uint8)
        array = pixels.permute(1, 2, 0).cpu().numpy()  # CHW -> HWC for PIL
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


class _JpegSize(Reward):
    sign: float = 1.0

    def __init__(self, quality: int = 95, device=None, dtype: torch.dtype = torch.float32, batch_size: int = 64):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if not 1 <= quality <= 100:
            raise ValueError(f"JPEG quality must be in [1, 100], got {quality}")
        self.quality = quality

    def score(self, images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
        return self.sign * jpeg_size_kb(images, self.quality)


@register("jpeg_compressibility")
class JpegCompressibility(_JpegSize):
    """Minus the JPEG (quality 95) size in kB: smaller files score higher (DDPO; needs: nothing)."""

    sign = -1.0


@register("jpeg_incompressibility")
class JpegIncompressibility(_JpegSize):
    """The JPEG (quality 95) size in kB: larger, more detailed files score higher (DDPO; needs: nothing)."""

    sign = 1.0
