"""LTX-2 beyond the registry contract (`test_families.py`): the audio generated with the video follows the pipeline's
ODE on every step and is not part of the policy's action; only the video branch trains; image-to-video keeps the
start frame's latent clean in the state."""

import pytest
import torch

from flowrl.models.families.ltx2 import LTX2Adapter
from flowrl.models.families.ltx2_i2v import LTX2I2VAdapter
from flowrl.policies import DiffusionPolicy
from flowrl.prompts.edit_shapes import draw


pytestmark = pytest.mark.models
OPTIONS = {"num_frames": 5, "max_sequence_length": 16}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_the_audio_follows_the_ode_and_the_log_prob_is_the_video_s_alone():
    policy = DiffusionPolicy.from_pipeline(LTX2Adapter.tiny(seed=2), options=OPTIONS)
    rollout = policy.rollout(
        ["a cat", "a dog"],
        num_steps=3,
        guidance_scale=3.0,
        noise_level=0.9,
        generator=_gen(1),
        height=64,
        width=64,
        store_means=True,
    )
    audio = policy.adapter.audio_size
    assert audio == 2 * 5 * 2  # 2 channels x round(5 / 24 s x 25 latents/s) x 8 / 4 mel bins
    cond = rollout.sample_cond()
    for t in range(rollout.num_steps):
        x, x_next = rollout.latents[:, t], rollout.latents[:, t + 1]
        _, v = policy.score_transitions(rollout, x, x_next, t, cond, return_prediction=True)
        dt = rollout.sigmas[t + 1] - rollout.sigmas[t]
        assert torch.equal(x_next[:, -audio:], (x[:, -audio:].float() + dt * v[:, -audio:].float()).to(x.dtype))
        assert not torch.equal(x_next[:, :-audio], (x[:, :-audio].float() + dt * v[:, :-audio].float()).to(x.dtype))
        # the step's Gaussian log-density, by hand, over the video elements only (mean reduction)
        mean, std = rollout.means[:, t].float(), rollout.stds[t]
        assert mean.shape == (2, x.shape[1] - audio)
        by_hand = -((x_next[:, :-audio].float() - mean) ** 2).mean(1) / (2 * std**2) - torch.log(std)
        by_hand = by_hand - 0.5 * torch.log(torch.tensor(2 * torch.pi))
        torch.testing.assert_close(rollout.log_probs[:, t], by_hand, rtol=1e-6, atol=1e-6)


def test_only_the_video_branch_trains():
    policy = DiffusionPolicy.from_pipeline(LTX2Adapter.tiny(seed=2), options=OPTIONS)
    policy.add_lora(rank=2, alpha=2)
    trained = {n.rsplit(".lora_", 1)[0] for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trained and not any("audio_attn" in n or "audio_ff" in n or "video_to_audio" in n for n in trained)
    assert any("audio_to_video_attn" in n for n in trained) and any(".ff.net.2" in n for n in trained)


def test_image_to_video_keeps_the_start_frame_latent_clean():
    policy = DiffusionPolicy.from_pipeline(LTX2I2VAdapter.tiny(seed=2), options={**OPTIONS, "image_crf": 0})
    start = draw("square", "green", (8, 8, 40, 40))
    rollout = policy.rollout(
        ["a cat"] * 2,
        num_steps=3,
        guidance_scale=1.0,
        noise_level=0.9,
        generator=_gen(3),
        height=64,
        width=64,
        source_images=[start] * 2,
    )
    head = rollout.edit_cond["start_latents"][0]  # the first latent frame's 8 x 8 tokens of 4 channels
    assert head.shape == (8 * 8 * 4,)
    assert all(torch.equal(rollout.latents[:, t, : head.numel()], head.expand(2, -1)) for t in range(4))
    assert not torch.equal(rollout.latents[:, 1, head.numel() :], rollout.latents[:, 0, head.numel() :])
    with pytest.raises(ValueError, match="needs a start image"):
        policy.rollout(["a cat"], num_steps=2, height=64, width=64, generator=_gen())


def test_the_text_registers_fill_the_padding_so_no_mask_is_passed():
    pipe = LTX2Adapter.tiny(seed=0)
    with pytest.raises(ValueError, match=r"max_sequence_length \(12\) must be a multiple of 8$"):
        DiffusionPolicy.from_pipeline(pipe, options={**OPTIONS, "max_sequence_length": 12})
    adapter = DiffusionPolicy.from_pipeline(pipe, options=OPTIONS).adapter
    cond = adapter.encode(["a cat", "a red dog"])  # both shorter than 16 tokens: left-padded
    tokens = adapter.pipeline.tokenizer(["a cat", "a red dog"]).input_ids
    assert max(map(len, tokens)) < 16 and cond["prompt_attention_mask"].all()  # all zeros added: none passed
    seen = []
    hook = adapter.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["encoder_attention_mask"]), with_kwargs=True
    )
    latents = torch.randn(2, 2 * 8 * 8 * 4 + adapter.audio_size, generator=_gen())
    adapter.forward(latents, torch.full((2,), 0.5), cond, 1.0, static=adapter.static_inputs(64, 64))
    hook.remove()
    assert seen == [None]
