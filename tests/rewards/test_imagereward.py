"""ImageReward on a tiny random checkpoint in the official key layout, loaded through the key mapper."""

import pytest
import torch

from flowrl import rewards
from flowrl.rewards.imagereward import REWARD_MEAN, REWARD_STD, load_imagereward, map_imagereward_state_dict
from tests.rewards.conftest import PROMPTS
from tests.rewards.tiny_models import imagereward_official_state, reference_head, reference_vit, write_bert_vocab


@pytest.fixture(scope="module")
def reward(imagereward_file, bert_dir):
    return rewards.get("imagereward", checkpoint=str(imagereward_file), tokenizer=str(bert_dir))


def test_key_mapper_covers_every_parameter():
    from transformers import BlipTextModel, BlipVisionModel

    from flowrl.rewards.imagereward import text_config_from, vision_config_from

    parts = map_imagereward_state_dict(imagereward_official_state())
    vision = BlipVisionModel(vision_config_from(parts["vision"]))
    text = BlipTextModel(text_config_from(parts["text"]), add_pooling_layer=False)
    assert set(parts["vision"]) == set(vision.state_dict())
    assert set(parts["text"]) == set(text.state_dict())  # med.BertModel names == BlipTextModel names
    assert sorted(parts["head"]) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    assert vision.config.num_attention_heads == 2 and vision.config.image_size == 32
    assert text.config.encoder_hidden_size == 128 and text.config.vocab_size == 30524


def test_mapped_vision_encoder_equals_blips_vit(imagereward_file, bert_dir):
    state = imagereward_official_state()
    model, _ = load_imagereward(imagereward_file, bert_dir)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.vision(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(ours, reference_vit(state, pixels), atol=1e-5, rtol=1e-4)


def test_score_is_the_normalised_head_on_the_first_text_token(reward, images):
    state = imagereward_official_state()
    ids, mask = reward.tokenize(PROMPTS)
    assert ids.shape == (3, 35) and (ids[:, 0] == 101).all()  # [CLS] first, as the official scorer
    pixels = reward.image_settings(images)
    with torch.no_grad():
        tokens = reward.model.vision(pixel_values=pixels).last_hidden_state
        first = reward.model.text(input_ids=ids, attention_mask=mask, encoder_hidden_states=tokens).last_hidden_state
    head = {k[len("mlp.") :]: v for k, v in state.items() if k.startswith("mlp.")}
    expected = (reference_head(head, first[:, 0]) - REWARD_MEAN) / REWARD_STD
    scores = reward(images, PROMPTS)
    assert scores.shape == (3,) and torch.isfinite(scores).all()
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(scores, reward(1 - images, PROMPTS))


def test_gradients_reach_the_pixels(reward, images):
    pixels = images.clone().requires_grad_(True)
    reward.score(pixels, PROMPTS).sum().backward()
    assert pixels.grad is not None and pixels.grad.abs().sum() > 0
    assert not any(p.requires_grad for p in reward.model.parameters())


def test_tokenizer_has_blips_added_tokens_and_enc_option(imagereward_file, bert_dir, reward):
    tok = reward.tokenizer
    assert len(tok) == 30524 and tok.convert_tokens_to_ids("[DEC]") == 30522
    assert tok.convert_tokens_to_ids("[ENC]") == 30523
    enc = rewards.get(
        "imagereward", checkpoint=str(imagereward_file), tokenizer=str(bert_dir / "vocab.txt"), enc_token=True
    )
    ids, _ = enc.tokenize(PROMPTS)
    assert (ids[:, 0] == 30523).all() and (ids[:, 1:] == reward.tokenize(PROMPTS)[0][:, 1:]).all()


def test_small_tokenizer_is_refused(imagereward_file, tmp_path):
    small = write_bert_vocab(tmp_path / "small", size=500)
    with pytest.raises(rewards.RewardWeightsError, match=r"'imagereward'.*only \d+ tokens.*vocab.txt.*hf download"):
        rewards.get("imagereward", checkpoint=str(imagereward_file), tokenizer=str(small))


def test_wrong_checkpoint_is_refused(bert_dir, tmp_path):
    torch.save({"something.else": torch.zeros(1)}, tmp_path / "ImageReward.pt")
    with pytest.raises(ValueError, match="not an ImageReward checkpoint"):
        rewards.get("imagereward", checkpoint=str(tmp_path), tokenizer=str(bert_dir))
