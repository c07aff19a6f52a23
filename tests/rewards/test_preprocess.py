import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.rewards.preprocess import ImageSettings, center_crop, read_processor_config, resize_shortest_side


def test_resize_keeps_aspect_and_crop_is_central():
    x = torch.rand(2, 3, 40, 60)
    y = resize_shortest_side(x, 20)
    assert y.shape == (2, 3, 20, 30)
    assert resize_shortest_side(torch.rand(1, 3, 60, 40), 20).shape == (1, 3, 30, 20)
    grid = torch.arange(7 * 9.0).reshape(1, 1, 7, 9)
    crop = center_crop(grid, 3, 5)
    assert crop[0, 0, 0, 0] == grid[0, 0, 2, 2]  # offsets round((7-3)/2)=2, round((9-5)/2)=2
    with pytest.raises(ValueError, match="cannot centre-crop"):
        center_crop(grid, 8, 8)


def test_downsampling_matches_pil_bicubic():
    """torch's antialiased bicubic agrees with PIL's bicubic resize (what the released processors use)."""
    g = torch.Generator().manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.rand(1, 3, 8, 8, generator=g), size=(64, 64), mode="bilinear")
    ours = resize_shortest_side(smooth, 32)[0]
    pil = [np.asarray(Image.fromarray(c.numpy(), mode="F").resize((32, 32), Image.BICUBIC)) for c in smooth[0]]
    torch.testing.assert_close(ours, torch.tensor(np.stack(pil)), atol=0.02, rtol=0)


def test_settings_from_processor_config_and_normalisation(tmp_path):
    config = {
        "size": {"shortest_edge": 16},
        "crop_size": {"height": 16, "width": 12},
        "image_mean": [0.5] * 3,
        "image_std": [0.25] * 3,
    }
    settings = ImageSettings.from_processor_config(config, default_size=224)
    assert settings == ImageSettings(size=16, crop=(16, 12), mean=(0.5,) * 3, std=(0.25,) * 3)
    out = settings(torch.full((1, 3, 20, 30), 0.75))
    assert out.shape == (1, 3, 16, 12)
    torch.testing.assert_close(out, torch.ones_like(out))  # (0.75 - 0.5) / 0.25
    assert read_processor_config(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text('{"size": 8}')
    assert read_processor_config(tmp_path) == {"size": 8}


def test_preprocessing_is_differentiable():
    x = torch.rand(2, 3, 40, 48, requires_grad=True)
    ImageSettings.square(32)(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
