"""open_clip-backed rewards (hpsv2, clip_score backend="open_clip") on a tiny open_clip config.

open_clip is an optional extra for GPU machines (it pulls torchvision); these tests skip without it.
"""

import json

import pytest
import torch

from flowrl import rewards
from tests.rewards.conftest import PROMPTS


open_clip = pytest.importorskip("open_clip")

TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openclip")
    (folder / "flowrl-tiny-clip.json").write_text(json.dumps(TINY))
    open_clip.add_model_config(str(folder / "flowrl-tiny-clip.json"))
    torch.manual_seed(0)
    model = open_clip.create_model("flowrl-tiny-clip", pretrained=None)
    torch.save(
        {"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, folder / "HPS_v2.1_compressed.pt"
    )
    torch.save(model.state_dict(), folder / "plain.pt")
    return folder, model.eval()


def _reference_cos(model, images):
    from flowrl.rewards.preprocess import ImageSettings

    with torch.no_grad():
        image = model.encode_image(ImageSettings.square(32)(images), normalize=True)
        text = model.encode_text(open_clip.get_tokenizer("flowrl-tiny-clip")(PROMPTS), normalize=True)
    return (image * text).sum(-1)


def test_hpsv2_is_the_cosine_of_the_checkpoint_features(tiny_checkpoint, images):
    folder, model = tiny_checkpoint
    reward = rewards.get("hpsv2", checkpoint=str(folder), arch="flowrl-tiny-clip")
    scores = reward(images, PROMPTS)
    assert scores.shape == (3,) and torch.isfinite(scores).all()
    torch.testing.assert_close(scores, _reference_cos(model, images), atol=1e-5, rtol=1e-4)
    pixels = images.clone().requires_grad_(True)
    reward.score(pixels, PROMPTS).sum().backward()
    assert pixels.grad.abs().sum() > 0


def test_clip_score_open_clip_backend(tiny_checkpoint, images):
    folder, model = tiny_checkpoint
    reward = rewards.get(
        "clip_score", backend="open_clip", model="flowrl-tiny-clip", pretrained=str(folder / "plain.pt")
    )
    torch.testing.assert_close(reward(images, PROMPTS), _reference_cos(model, images), atol=1e-5, rtol=1e-4)


def test_hpsv2_missing_checkpoint(tmp_path):
    with pytest.raises(rewards.RewardWeightsError, match=r"'hpsv2'.*HPS_v2.1_compressed.pt.*hf download xswu/HPSv2"):
        rewards.get("hpsv2", checkpoint=str(tmp_path))


def test_unavailable_open_clip_weights(tiny_checkpoint):
    with pytest.raises(
        rewards.RewardWeightsError, match=r"'clip_score'.*open_clip 'flowrl-tiny-clip' weights 'openai'"
    ):
        rewards.get("clip_score", backend="open_clip", model="flowrl-tiny-clip", pretrained="openai")
