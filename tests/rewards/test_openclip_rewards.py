"""open_clip itself, on a tiny open_clip config: clip_score's `backend="open_clip"`, and HPSv2's conversion of
open_clip weights to transformers checked against open_clip's own model (tests/rewards/test_hpsv2.py checks it
everywhere against open_clip's forward written out).

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
    torch.save(model.state_dict(), folder / "plain.pt")
    return folder, model.eval()


def _reference_cos(model, images):
    from flowrl.rewards.preprocess import ImageSettings

    with torch.no_grad():
        image = model.encode_image(ImageSettings.square(32)(images), normalize=True)
        text = model.encode_text(open_clip.get_tokenizer("flowrl-tiny-clip")(PROMPTS), normalize=True)
    return (image * text).sum(-1)


def test_hps_conversion_matches_open_clips_model(tiny_checkpoint, images):
    from flowrl.rewards.openclip_to_hf import OpenCLIPArch, open_clip_to_clip
    from flowrl.rewards.preprocess import ImageSettings

    _, model = tiny_checkpoint
    converted = open_clip_to_clip(model.state_dict(), OpenCLIPArch(vision_head_width=32, text_head_width=32)).eval()
    pixels = ImageSettings.square(32)(images)
    ids = open_clip.get_tokenizer("flowrl-tiny-clip")(PROMPTS)
    with torch.no_grad():
        image = converted.visual_projection(converted.vision_model(pixel_values=pixels).pooler_output)
        text = converted.text_projection(converted.text_model(input_ids=ids).pooler_output)
        torch.testing.assert_close(image, model.encode_image(pixels), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(text, model.encode_text(ids), atol=1e-5, rtol=1e-4)


def test_clip_score_open_clip_backend(tiny_checkpoint, images):
    folder, model = tiny_checkpoint
    reward = rewards.get(
        "clip_score", backend="open_clip", model="flowrl-tiny-clip", pretrained=str(folder / "plain.pt")
    )
    torch.testing.assert_close(reward(images, PROMPTS), _reference_cos(model, images), atol=1e-5, rtol=1e-4)


def test_unavailable_open_clip_weights(tiny_checkpoint):
    with pytest.raises(
        rewards.RewardWeightsError, match=r"'clip_score'.*open_clip 'flowrl-tiny-clip' weights 'openai'"
    ):
        rewards.get("clip_score", backend="open_clip", model="flowrl-tiny-clip", pretrained="openai")
