"""aesthetic, clip_score and pickscore on a tiny random CLIPModel saved with save_pretrained."""

import pytest
import torch
from safetensors.torch import save_file

from flowrl import rewards
from tests.rewards.conftest import PROMPTS
from tests.rewards.tiny_models import aesthetic_head_state, reference_head


def _build(name, clip_dir, head_file):
    if name == "aesthetic":
        return rewards.get("aesthetic", model=str(clip_dir), head=str(head_file))
    if name == "pickscore":
        return rewards.get("pickscore", model=str(clip_dir), processor=None)
    return rewards.get("clip_score", model=str(clip_dir))


@pytest.fixture(scope="module")
def built(clip_dir, head_file):
    return {name: _build(name, clip_dir, head_file) for name in ("aesthetic", "clip_score", "pickscore")}


@pytest.mark.parametrize("name", ["aesthetic", "clip_score", "pickscore"])
def test_scores_shape_finite_and_depend_on_the_image(built, name, images):
    reward = built[name]
    scores = reward(images, PROMPTS)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    assert not torch.allclose(scores, reward(1 - images, PROMPTS))
    assert reward.differentiable


@pytest.mark.parametrize("name", ["aesthetic", "clip_score", "pickscore"])
def test_gradients_reach_the_pixels(built, name, images):
    pixels = images.clone().requires_grad_(True)
    built[name].score(pixels, PROMPTS).sum().backward()
    assert pixels.grad is not None and pixels.grad.abs().sum() > 0
    modules = [m for m in vars(built[name]).values() if isinstance(m, torch.nn.Module)]
    assert modules and not any(p.requires_grad for m in modules for p in m.parameters())  # frozen reward model


def test_call_batches_and_matches_score(clip_dir, head_file, images):
    one_by_one = rewards.get("aesthetic", model=str(clip_dir), head=str(head_file), batch_size=1)
    with torch.no_grad():
        direct = one_by_one.score(images, PROMPTS)
    torch.testing.assert_close(one_by_one(images, PROMPTS), direct, atol=1e-5, rtol=1e-5)


def test_aesthetic_is_the_released_head_on_unit_clip_embeddings(built, images):
    reward = built["aesthetic"]
    embeds = reward.embed(images)
    torch.testing.assert_close(embeds.norm(dim=-1), torch.ones(3))
    expected = reference_head(aesthetic_head_state(), embeds)
    torch.testing.assert_close(reward(images, PROMPTS), expected, atol=1e-5, rtol=1e-5)


def test_aesthetic_accepts_safetensors_head_and_folders(clip_dir, head_file, tmp_path, images):
    save_file(aesthetic_head_state(), tmp_path / "sac+logos+ava1-l14-linearMSE.safetensors")
    from_folder = rewards.get("aesthetic", model=str(clip_dir), head=str(tmp_path))
    from_pth = rewards.get("aesthetic", model=str(clip_dir), head=str(head_file))
    torch.testing.assert_close(from_folder(images, PROMPTS), from_pth(images, PROMPTS))


def test_aesthetic_refuses_a_head_of_the_wrong_width(clip_dir, tmp_path):
    torch.save(aesthetic_head_state(d_in=768), tmp_path / "head.pth")
    with pytest.raises(ValueError, match="768-d embeddings but the CLIP model"):
        rewards.get("aesthetic", model=str(clip_dir), head=str(tmp_path / "head.pth"))
    torch.save({"weight": torch.zeros(1, 16)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="layers.<i>.weight"):
        rewards.get("aesthetic", model=str(clip_dir), head=str(tmp_path / "bad.pth"))


def test_clip_score_scales(clip_dir, images):
    cos = rewards.get("clip_score", model=str(clip_dir))(images, PROMPTS)
    assert (cos.abs() <= 1).all()
    hessel = rewards.get("clip_score", model=str(clip_dir), scale="clipscore")(images, PROMPTS)
    torch.testing.assert_close(hessel, 2.5 * cos.clamp_min(0))
    flow_grpo = rewards.get("clip_score", model=str(clip_dir), scale="flow_grpo")
    torch.testing.assert_close(flow_grpo(images, PROMPTS), flow_grpo.clip.logit_scale * cos / 30)
    with pytest.raises(ValueError, match="scale must be one of"):
        rewards.get("clip_score", model=str(clip_dir), scale="logits")
    with pytest.raises(ValueError, match="backend"):
        rewards.get("clip_score", model=str(clip_dir), backend="jax")


def test_clip_score_is_the_cosine_of_the_real_clip_embeddings(built, clip_dir, images):
    from transformers import CLIPModel

    from flowrl.rewards.preprocess import ImageSettings

    model = CLIPModel.from_pretrained(clip_dir).eval()
    tok = built["clip_score"].clip.tokenizer(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(
            input_ids=tok.input_ids, attention_mask=tok.attention_mask, pixel_values=ImageSettings.square(32)(images)
        )
    expected = out.logits_per_image.diagonal() / model.logit_scale.exp()
    torch.testing.assert_close(built["clip_score"](images, PROMPTS), expected, atol=1e-5, rtol=1e-4)


def test_pickscore_divides_logit_scaled_cosine(clip_dir, built, images):
    cos = built["clip_score"](images, PROMPTS)
    raw = rewards.get("pickscore", model=str(clip_dir), processor=None, divisor=1.0)
    scale = raw.clip.logit_scale
    torch.testing.assert_close(raw(images, PROMPTS), scale * cos, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(built["pickscore"](images, PROMPTS), scale * cos / 26, atol=1e-5, rtol=1e-5)


def test_text_embeddings_are_computed_once_per_prompt(clip_dir, images):
    reward = rewards.get("clip_score", model=str(clip_dir))
    calls = []
    encode = reward.clip.text._encode
    reward.clip.text._encode = lambda prompts: calls.append(list(prompts)) or encode(prompts)
    reward(images, PROMPTS)
    reward(images, PROMPTS[::-1])
    assert calls == [["a photo of a cat", "a red dog"]]
