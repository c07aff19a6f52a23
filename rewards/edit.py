"""Weight-free editing rewards: they read each sample's source images (`needs_source_images`).

`edit_consistency` is the structural similarity (SSIM, Wang et al. 2004, 11 x 11 Gaussian window, sigma 1.5,
`C1 = 0.01^2`, `C2 = 0.03^2`) between the result and its first source image, averaged over the pixels the edit should
leave alone: outside the metadata's `region` (`[x0, y0, x1, y1]` as fractions of the image) when a row has one,
everywhere otherwise (pixels whose window reaches into the region are left out too, so an edit confined to the
region costs nothing). An untouched image scores 1, the maximum. `edit_color` scores the instruction of the shipped
`edit_shapes` set: 1 minus the mean absolute RGB distance between the target `color` and the result's pixels where
the source had its shape (non-white pixels inside `region`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowrl.rewards import register
from flowrl.rewards.base import Reward


WINDOW = 11
"""The SSIM window (pixels)."""


def _gaussian(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """`[size]` normalised 1-D Gaussian weights."""
    x = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def ssim_map(x: torch.Tensor, y: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Per-pixel SSIM `[B, H, W]` of images `x, y [B, 3, H, W]` in [0, 1] (channel mean; separable Gaussian window,
    zero padding). Identical images give exactly 1: numerator and denominator are then the same numbers."""
    x, y = x.float(), y.float()
    b, c, h, w = x.shape
    pad, g = window // 2, _gaussian(window, sigma).to(x.device)
    # the five local moments in one batch of single-channel images, blurred by two 1-D convolutions
    t = torch.stack([x, y, x * x, y * y, x * y]).reshape(5 * b * c, 1, h, w)
    t = F.conv2d(F.conv2d(t, g.view(1, 1, window, 1), padding=(pad, 0)), g.view(1, 1, 1, window), padding=(0, pad))
    mu_x, mu_y, xx, yy, xy = t.reshape(5, b, c, h, w)
    var_x, var_y, cov = xx - mu_x * mu_x, yy - mu_y * mu_y, xy - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2))
    return s.mean(1)


def region_mask(region, height: int, width: int, device=None) -> torch.Tensor:
    """`[H, W]` bool: the pixels inside `region` `[x0, y0, x1, y1]` (fractions of the image, inclusive)."""
    x0, y0, x1, y1 = region
    ys = (torch.arange(height, device=device) + 0.5) / height
    xs = (torch.arange(width, device=device) + 0.5) / width
    inside_y = (ys >= y0) & (ys <= y1 + 1 / height)
    inside_x = (xs >= x0) & (xs <= x1 + 1 / width)
    return inside_y[:, None] & inside_x[None, :]


def _first_source(source_images, images: torch.Tensor, name: str) -> torch.Tensor:
    """`[B, 3, H, W]`: each sample's first source image at the result's size (bilinear, antialiased)."""
    if source_images is None:
        raise ValueError(
            f"reward {name!r} compares edits with their source images: use an editing prompt set "
            "(rows with `image`, or `edit_shapes/train`) on an editing model"
        )
    source = source_images[:, 0].to(images.device, torch.float32)
    if source.shape[-2:] != images.shape[-2:]:
        source = F.interpolate(source, size=images.shape[-2:], mode="bilinear", antialias=True, align_corners=False)
    return source.clamp(0, 1)


@register("edit_consistency")
class EditConsistency(Reward):
    """Editing: SSIM with the source image outside the edited `region` (1 = untouched; needs: nothing)."""

    needs_source_images = True

    def __init__(
        self, outside_region: bool = True, device=None, dtype: torch.dtype = torch.float32, batch_size: int = 64
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.outside_region = outside_region

    def score(self, images, prompts, source_images=None, region=None, **metadata):
        images = images.float().clamp(0, 1)
        source = _first_source(source_images, images, self.name)
        s = ssim_map(images, source)  # [B, H, W]
        keep = torch.ones_like(s, dtype=torch.bool)
        if self.outside_region and region is not None:
            for i, box in enumerate(region):
                if box is not None:  # and the pixels whose SSIM window reaches into it (dilated by its radius)
                    inside = region_mask(box, *s.shape[-2:], device=s.device).float()[None, None]
                    keep[i] = F.max_pool2d(inside, 2 * (WINDOW // 2) + 1, stride=1, padding=WINDOW // 2)[0, 0] == 0
        return ((s * keep).sum((1, 2)) / keep.sum((1, 2)).clamp(min=1)).float()


@register("edit_color")
class EditColor(Reward):
    """Editing (`edit_shapes`): 1 - mean RGB distance to the target colour on the shape (needs: region, color)."""

    needs_source_images = True

    def score(self, images, prompts, source_images=None, region=None, color=None, **metadata):
        if region is None or color is None:
            raise ValueError(f"reward {self.name!r} needs `region` and `color` in the prompt metadata (edit_shapes)")
        images = images.float().clamp(0, 1)
        source = _first_source(source_images, images, self.name)
        shape = (source < 0.9).any(1)  # [B, H, W]: the drawn shape's pixels (the canvas is white)
        out = []
        for i in range(len(images)):
            mask = shape[i] & region_mask(region[i], *images.shape[-2:], device=images.device)
            target = torch.tensor(color[i], dtype=torch.float32, device=images.device)[:, None]
            pixels = images[i][:, mask]  # [3, n]
            out.append(1 - (pixels - target).abs().mean() if pixels.numel() else torch.tensor(float("nan")))
        return torch.stack(out).float()
