import pytest
import torch

from flowrl import rewards
from flowrl.digits import DIGIT_WORDS, decode, digit_of, read_prompts, real_digits, split, to_pixels
from flowrl.digits.build import BuildConfig


def test_digit_parsing():
    assert digit_of("a handwritten seven") == 7
    assert digit_of("the number 7") == 7
    assert digit_of("Digit 0, written by hand") == 0
    assert digit_of("handwriting: 3") == 3
    with pytest.raises(ValueError, match="names no digit"):
        digit_of("a cat")
    with pytest.raises(ValueError, match=r"several digits \[1, 2\]"):
        digit_of("one plus 2")
    assert digit_of("seven, 7") == 7  # the same digit twice is fine


def test_prompt_sets_cover_every_digit_with_held_out_phrasings():
    """Train, test and validation (what the main job selects its checkpoint on) cover every digit, each in
    phrasings of its own: neither the test nor the validation phrasings are seen in training (or pretraining, which
    uses the training prompts), and the validation set shares none with the test set it must stay apart from."""
    train, test, val = read_prompts("train"), read_prompts("test"), read_prompts("val")
    for prompts in (test, val):
        assert sorted({digit_of(p) for p in train}) == list(range(10)) == sorted({digit_of(p) for p in prompts})
    assert not set(train) & set(test) and not set(train) & set(val) and not set(test) & set(val)
    template = lambda p: p.replace(DIGIT_WORDS[digit_of(p)], "{}").replace(str(digit_of(p)), "{}")  # noqa: E731
    phrasings = [{template(p) for p in prompts} for prompts in (train, test, val)]
    assert len(val) == 20
    assert not phrasings[0] & phrasings[1] and not phrasings[0] & phrasings[2] and not phrasings[1] & phrasings[2]
    from flowrl import prompts

    assert [p.text for p in prompts.load("digits/train")] == train
    assert [p.text for p in prompts.load("digits/val")] == val and "digits/val" in prompts.list_sets()


def test_real_data_and_pixels():
    images, labels = real_digits()
    assert images.shape == (1797, 1, 8, 8) and 0 <= images.min() and images.max() <= 1
    a, b = split(0)
    assert len(set(a.tolist()) & set(b.tolist())) == 0 and len(a) + len(b) == 1797
    rgb = decode(images[:4] * 2 - 1)
    assert rgb.shape == (4, 3, 8, 8)
    torch.testing.assert_close(to_pixels(rgb), images[:4])
    big = torch.nn.functional.interpolate(rgb, size=(32, 32), mode="nearest")
    torch.testing.assert_close(to_pixels(big), images[:4])  # any image size maps back to 8x8


def test_real_digits_are_scikit_learns_load_digits(monkeypatch):
    """Read from scikit-learn's file without importing it, and through `load_digits` where the file is missing:
    the same images and labels."""
    from sklearn.datasets import load_digits

    from flowrl.digits import data

    bundled = load_digits()
    expected = torch.tensor(bundled.images, dtype=torch.float32).unsqueeze(1) / 16.0, torch.tensor(bundled.target)
    for missing in (False, True):
        if missing:
            monkeypatch.setattr(data.Path, "is_file", lambda self: False)
        data.real_digits.cache_clear()
        images, labels = data.real_digits()
        assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
    monkeypatch.undo()
    data.real_digits.cache_clear()


def test_build_config_keys_separate_model_and_classifiers():
    base = BuildConfig()
    assert BuildConfig(pretrain_steps=10).classifier_key() == base.classifier_key()
    assert BuildConfig(pretrain_steps=10).model_key() != base.model_key()
    assert BuildConfig(classifier_epochs=3).model_key() == base.model_key()


def test_digits_rewards_on_real_digits(tiny_world):
    images, labels = real_digits()
    _, held_out = split(0)
    idx = held_out[:40]
    rgb = decode(images[idx] * 2 - 1)
    right = [f"the number {d}" for d in labels[idx].tolist()]
    wrong = [f"the number {(d + 1) % 10}" for d in labels[idx].tolist()]
    get = lambda name: rewards.get(name, classifiers=tiny_world.classifiers)  # noqa: E731
    align = get("digits_alignment")
    assert align(rgb, right).mean() > align(rgb, wrong).mean() + 0.3
    assert get("digits_gold")(rgb, right).mean() > 0.5
    acc = get("digits_accuracy")(rgb, right)
    assert set(acc.unique().tolist()) <= {0.0, 1.0}
    realism = get("digits_realism")
    real = realism(rgb, right)
    noise = realism(torch.rand(40, 3, 8, 8), right)
    assert real.mean() < 1.5 < noise.mean()  # real digits are about as close as held-out reals; noise is far
    # the alignment reward is differentiable to the pixels
    x = rgb.clone().requires_grad_(True)
    align.score(x, right).sum().backward()
    assert x.grad.abs().sum() > 0


def test_the_hackable_proxy_pays_the_logit_margin_and_ink(tiny_world):
    images, labels = real_digits()
    rgb = decode(images[:12] * 2 - 1)
    prompts = [f"the number {d}" for d in labels[:12].tolist()]
    hackable = rewards.get("digits_hackable", classifiers=tiny_world.classifiers, logit_weight=0.5, ink_weight=2.0)
    logits = tiny_world.classifiers.reward(to_pixels(rgb))
    margins = torch.stack(
        [
            logits[i, d] - torch.cat([logits[i, :d], logits[i, d + 1 :]]).logsumexp(0)
            for i, d in enumerate(labels[:12].tolist())
        ]
    )
    ink = to_pixels(rgb).flatten(1).mean(1)
    torch.testing.assert_close(hackable(rgb, prompts), 0.5 * margins + 2.0 * ink)
    # it keeps paying where the alignment probability has saturated: more ink always scores more
    ink_only = rewards.get("digits_hackable", classifiers=tiny_world.classifiers, logit_weight=0.0)
    assert (ink_only((rgb + 0.2).clamp(0, 1), prompts) > ink_only(rgb, prompts)).all()


def test_registered_with_descriptions():
    described = rewards.REWARDS.describe()
    for name in ("digits_alignment", "digits_accuracy", "digits_gold", "digits_realism"):
        assert "Digits world" in described[name]


def test_minilm_encodes_each_prompt_once_whatever_it_is_batched_with():
    from flowrl.digits.nets import MiniLMEncoder

    encoder = MiniLMEncoder()
    calls = []
    forward = encoder.model.forward
    encoder.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    prompts = read_prompts("train")[:6]
    first = encoder.encode(prompts[:4] + prompts[:2])  # [6, 16, 384]: two repeated
    assert len(calls) == 4 and first["prompt_embeds"].shape == (6, 16, 384) and first["pooled"].shape == (6, 384)
    again = encoder.encode(prompts[::-1])
    assert len(calls) == 6  # only the two new prompts ran
    assert torch.equal(again["prompt_embeds"][2:], first["prompt_embeds"][:4].flip(0))
    assert torch.equal(first["prompt_embeds"][4:], first["prompt_embeds"][:2])
    alone = MiniLMEncoder().encode(prompts[3:4])  # a fresh encoder, the prompt alone: the same bits
    assert torch.equal(alone["prompt_embeds"][0], first["prompt_embeds"][3])
    assert torch.equal(alone["pooled"][0], first["pooled"][3])
