import pytest
import torch

from flowrl import rewards
from flowrl.rewards.jpeg import jpeg_size_kb


def test_flat_image_is_more_compressible_than_noise():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    images, prompts = torch.cat([flat, noise]), ["a", "b"]
    comp = rewards.get("jpeg_compressibility")(images, prompts)
    incomp = rewards.get("jpeg_incompressibility")(images, prompts)
    assert comp.shape == (2,) and comp.dtype == torch.float32
    assert comp[0] > comp[1] and incomp[1] > incomp[0]
    torch.testing.assert_close(comp, -incomp)
    assert 0 < incomp[0] < 2 < incomp[1]  # a flat 64x64 JPEG is well under 2 kB, noise is several kB


def test_size_follows_quality_and_is_in_kilobytes():
    noise = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    low, high = jpeg_size_kb(noise, quality=10), jpeg_size_kb(noise, quality=95)
    assert (low < high).all()
    with pytest.raises(ValueError, match="quality"):
        rewards.get("jpeg_compressibility", quality=0)
