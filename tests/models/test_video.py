"""Video on the `[B, K]` core: Wan 2.1 / 2.2 tiny policies (videos `[B, 3, F, H, W]`), rewards on videos (`per_frame`,
`temporal_consistency`), .mp4 files and frame grids, and a GRPO-Guard update of a Wan LoRA."""

import math

import pytest
import torch

from flowrl import rewards
from flowrl.models.families.wan import WanAdapter
from flowrl.policies import DiffusionPolicy
from flowrl.rewards.jpeg import jpeg_size_kb
from flowrl.trainers import build_trainer, load_config
from flowrl.video import contact_sheet, frame_strips, read_mp4, write_mp4


OPTIONS = {"num_frames": 5, "max_sequence_length": 16}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def brightness(images, prompts, **metadata):
    """Mean pixel of each image `[B, 3, H, W]`, times the per-sample `scale` metadata when given."""
    scale = torch.as_tensor(metadata.get("scale", [1.0] * len(images)), dtype=torch.float32)
    return images.float().mean(dim=(1, 2, 3)) * scale


def _ramp_video(b=2, f=3, size=16):
    """`[b, 3, f, size, size]`: sample i, frame j is the constant `(i + 1) (j + 1) / 10`."""
    values = torch.tensor([[(i + 1) * (j + 1) / 10 for j in range(f)] for i in range(b)])
    return values.view(b, 1, f, 1, 1).expand(b, 3, f, size, size).clone()


# ------------------------------------------------------------------------------------------
# rewards on videos
# ------------------------------------------------------------------------------------------


def test_per_frame_is_the_mean_of_the_image_reward_over_frames():
    video = _ramp_video()
    reward = rewards.get("per_frame", reward="tests.models.test_video:brightness")
    # sample 0: (0.1 + 0.2 + 0.3) / 3 = 0.2; sample 1: (0.2 + 0.4 + 0.6) / 3 = 0.4; metadata repeats per frame
    torch.testing.assert_close(reward(video, ["a", "b"]), torch.tensor([0.2, 0.4]))
    torch.testing.assert_close(reward(video, ["a", "b"], scale=[1.0, 10.0]), torch.tensor([0.2, 4.0]))
    first_last = rewards.get("per_frame", reward="tests.models.test_video:brightness", max_frames=2)
    torch.testing.assert_close(first_last(video, ["a", "b"]), torch.tensor([0.2, 0.4]))  # (0.1 + 0.3) / 2, ...


def test_an_image_reward_scores_videos_frame_by_frame():
    noise = torch.rand(2, 3, 3, 16, 16, generator=_gen())
    by_hand = torch.stack([-jpeg_size_kb(noise[:, :, f]) for f in range(3)], dim=1).mean(1)
    jpeg = rewards.get("jpeg_compressibility")
    torch.testing.assert_close(jpeg(noise, ["a", "b"]), by_hand)
    torch.testing.assert_close(rewards.get("per_frame", reward="jpeg_compressibility")(noise, ["a", "b"]), by_hand)


def test_temporal_consistency_is_one_for_a_still_video_and_lower_when_frames_change():
    reward = rewards.get("temporal_consistency")
    still = torch.rand(1, 3, 1, 8, 8).expand(1, 3, 5, 8, 8)
    ramp = torch.linspace(0, 1, 3).view(1, 1, 3, 1, 1).expand(1, 3, 3, 8, 8)  # frames 0, 0.5, 1: change 0.5 each
    flicker = torch.tensor([0.0, 1.0, 0.0]).view(1, 1, 3, 1, 1).expand(1, 3, 3, 8, 8)
    scores = reward(torch.cat([still[:, :, :3], ramp, flicker]), ["a"] * 3)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.5, 0.0]))
    assert reward(still, ["a"]).item() == 1.0
    with pytest.raises(ValueError, match=r"videos \[B, 3, F, H, W\]"):
        reward(torch.rand(1, 3, 8, 8), ["a"])


# ------------------------------------------------------------------------------------------
# files and grids
# ------------------------------------------------------------------------------------------


def test_mp4_round_trip_keeps_the_frames(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    x = torch.linspace(0, 1, 32)
    video = torch.stack([(x.view(1, -1) + x.view(-1, 1) + t / 8).remainder(1).expand(3, 32, 32) for t in range(9)], 1)
    path = write_mp4(video, tmp_path / "v.mp4")
    back = read_mp4(path)
    assert back.shape == (3, 9, 32, 32)
    assert (back - video).abs().mean() < 0.05  # H.264 is lossy


def test_frame_strips_put_frames_side_by_side():
    video = torch.rand(2, 3, 5, 8, 8)
    strips = frame_strips(video, max_frames=3)  # frames 0, 2, 4, one white column apart
    assert strips.shape == (2, 3, 8, 3 * 9 - 1)
    assert torch.equal(strips[..., 9:17], video[:, :, 2]) and (strips[..., 8] == 1).all()
    assert frame_strips(video[:, :, 0]) is not None and frame_strips(video[:, :, 0]).shape == (2, 3, 8, 8)


def test_a_contact_sheet_is_a_video_s_first_middle_and_last_frames():
    video = torch.rand(3, 7, 8, 8)  # frames 0, 3 and 6, one white column apart
    sheet = contact_sheet(video)
    assert sheet.shape == (3, 8, 3 * 8 + 2)
    assert torch.equal(sheet[..., :8], video[:, 0]) and torch.equal(sheet[..., 9:17], video[:, 3])
    assert torch.equal(sheet[..., 18:], video[:, 6]) and (sheet[..., 8] == 1).all() and (sheet[..., 17] == 1).all()


# ------------------------------------------------------------------------------------------
# Wan policies
# ------------------------------------------------------------------------------------------


def test_wan22_routes_steps_to_its_two_experts_as_the_pipeline():
    """Wan 2.2: `transformer` above the boundary, `transformer_2` (with `guidance_scale_2`) below; bit-equal."""
    pipe = WanAdapter.tiny(seed=3, two_experts=True)
    pipe.set_progress_bar_config(disable=True)
    policy = DiffusionPolicy.from_pipeline(pipe, options={**OPTIONS, "guidance_scale_2": 2.0})
    prompts = ["a cat", "a dog"]
    rollout = policy.rollout(
        prompts, num_steps=4, guidance_scale=4.0, sampler="ode", generator=_gen(), height=32, width=32
    )
    video = pipe(
        prompts,
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=4.0,
        guidance_scale_2=2.0,
        output_type="pt",
        generator=_gen(),
        max_sequence_length=16,
    ).frames
    assert rollout.images.shape == (2, 3, 5, 32, 32)
    torch.testing.assert_close(rollout.images, video.transpose(1, 2), rtol=0, atol=1e-5)
    high = policy.adapter.high_noise(rollout.timesteps)
    assert high.any() and not high.all()  # both experts ran
    single = DiffusionPolicy.from_pipeline(WanAdapter.tiny(seed=3), options=OPTIONS)
    other = single.rollout(
        prompts, num_steps=4, guidance_scale=4.0, sampler="ode", generator=_gen(), height=32, width=32
    )
    assert (other.images - rollout.images).abs().max() > 1e-4  # the low-noise expert made a difference


def test_per_token_timesteps_of_wan22_ti2v_reproduce_the_pipeline():
    """Wan 2.2 TI2V-5B's layout (`expand_timesteps`: one timestep per latent token) in text-to-video mode."""
    pipe = WanAdapter.tiny(seed=3)
    pipe.register_to_config(expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    policy = DiffusionPolicy.from_pipeline(pipe, options=OPTIONS)
    rollout = policy.rollout(
        ["a cat"], num_steps=3, guidance_scale=4.0, sampler="ode", generator=_gen(), height=32, width=32
    )
    video = pipe(
        ["a cat"],
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=4.0,
        output_type="pt",
        generator=_gen(),
        max_sequence_length=16,
    ).frames
    torch.testing.assert_close(rollout.images, video.transpose(1, 2), rtol=0, atol=1e-5)


def test_wan22_trains_the_chosen_expert_only():
    pipe = WanAdapter.tiny(seed=3, two_experts=True)
    policy = DiffusionPolicy.from_pipeline(pipe, options={**OPTIONS, "trained_expert": "low_noise"})
    assert policy.model is pipe.transformer_2 and policy.adapter.lora_load_kwargs == {"load_into_transformer_2": True}
    policy.add_lora(rank=2)
    assert policy.trainable_parameters() and not any(p.requires_grad for p in pipe.transformer.parameters())
    with pytest.raises(ValueError, match="Wan 2.2"):
        DiffusionPolicy.from_pipeline(WanAdapter.tiny(seed=3), options={"trained_expert": "low_noise"})
    with pytest.raises(ValueError, match="num_frames"):
        DiffusionPolicy.from_pipeline(pipe, options={"num_frames": 4})


def test_wan22_trains_both_experts_as_one_module_and_exports_a_lora_for_each(tmp_path):
    """`trained_expert: both`: the rollout still equals the pipeline's, re-scores exactly with a LoRA on each expert,
    one backward reaches both LoRAs, and the export loads into diffusers (the low-noise expert's with
    `load_into_transformer_2`) to give the same video."""
    pipe = WanAdapter.tiny(seed=3, two_experts=True)
    pipe.set_progress_bar_config(disable=True)
    options = {**OPTIONS, "trained_expert": "both", "guidance_scale_2": 2.0}
    policy = DiffusionPolicy.from_pipeline(pipe, options=options, forward_batch_size=2)
    kwargs = dict(num_steps=4, guidance_scale=4.0, height=32, width=32)
    call = dict(
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=4.0,
        guidance_scale_2=2.0,
        output_type="pt",
        max_sequence_length=16,
    )
    plain = policy.rollout(["a cat"], sampler="ode", generator=_gen(), **kwargs).images
    torch.testing.assert_close(
        plain, pipe(["a cat"], generator=_gen(), **call).frames.transpose(1, 2), rtol=0, atol=1e-5
    )
    policy.add_lora(rank=2)
    lora = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    assert {n.split(".")[0] for n in lora} == {"transformer", "transformer_2"}
    with torch.no_grad():  # a stand-in for trained adapters
        for name, param in lora.items():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    rollout = policy.rollout(
        ["a cat", "a dog", "a cat"], sampler="flow_sde", noise_level=0.8, generator=_gen(1), **kwargs
    )
    steps = rollout.sde_steps.expand(3, -1)
    assert policy.adapter.high_noise(rollout.timesteps[rollout.sde_steps]).unique().numel() == 2  # both experts
    logp = policy.log_prob(rollout, steps)
    assert torch.equal(logp.detach(), rollout.log_probs[:, rollout.sde_steps])
    logp.sum().backward()
    grads = {n.split(".")[0] for n, p in lora.items() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads == {"transformer", "transformer_2"}
    trained = policy.rollout(["a cat"], sampler="ode", generator=_gen(), **kwargs).images
    assert (trained - plain).abs().max() > 1e-4
    policy.save_lora(tmp_path)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    assert (tmp_path / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    fresh = WanAdapter.tiny(seed=3, two_experts=True)
    fresh.set_progress_bar_config(disable=True)
    WanAdapter.load_lora_into(fresh, tmp_path)
    assert "load_into_transformer_2=True" in WanAdapter.lora_load_line(tmp_path)
    loaded = fresh(["a cat"], generator=_gen(), **call).frames.transpose(1, 2)
    torch.testing.assert_close(loaded, trained, rtol=0, atol=1e-5)
    again = DiffusionPolicy.from_pipeline(
        WanAdapter.tiny(seed=3, two_experts=True), options=options, forward_batch_size=2
    )
    again.load_lora(tmp_path)
    assert torch.equal(again.rollout(["a cat"], sampler="ode", generator=_gen(), **kwargs).images, trained)
    with pytest.raises(ValueError, match="trained_expert='both' needs a Wan 2.2 pipeline"):
        DiffusionPolicy.from_pipeline(WanAdapter.tiny(seed=3), options={"trained_expert": "both"})


@pytest.mark.parametrize("two_experts", [False, True, "both"], ids=["wan21", "wan22", "wan22_both"])
def test_grpo_guard_updates_a_wan_lora(two_experts, tmp_path):
    """Two optimizer steps of GRPO-Guard on tiny Wan videos scored per frame: finite loss, the LoRA moves, and the
    rollout re-scores exactly (ratio 1) at the sampling weights."""
    pipe = WanAdapter.tiny(seed=1, two_experts=bool(two_experts))
    pipe.set_progress_bar_config(disable=True)
    options = {**OPTIONS, "trained_expert": "both"} if two_experts == "both" else OPTIONS
    policy = DiffusionPolicy.from_pipeline(pipe, options=options, forward_batch_size=2)
    policy.add_lora(rank=4)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\n")
    config = load_config(
        {
            "trainer": "grpo_guard",
            "sampling": {"num_steps": 3, "guidance_scale": 3.0, "noise_level": 0.8, "height": 32, "width": 32},
            "batch": {"mini_batch_size": 2, "micro_batch_size": 2},  # 4 samples: 2 optimizer steps
            "prompts": {"train": str(prompts), "test": str(prompts), "prompts_per_epoch": 2, "group_size": 2},
            "rewards": [
                {"name": "per_frame"},
                {"name": "jpeg_compressibility", "weight": 0.0},
                {"name": "temporal_consistency"},
            ],
            "eval": {"every": 0, "samples_per_prompt": 1},
            "objective": {"clip_eps_low": 1e-2},
            "optim": {"lr": 1e-2},
            "run": {"epochs": 1, "log_with": [], "output_dir": str(tmp_path / "run")},
        }
    )
    fns = {
        "per_frame": rewards.get("per_frame", reward="tests.models.test_video:brightness"),
        "jpeg_compressibility": rewards.get("jpeg_compressibility"),  # an image reward on videos (logged only)
        "temporal_consistency": rewards.get("temporal_consistency"),
    }
    trainer = build_trainer(config, policy=policy, reward_fns=fns, eval_fns={})
    rollout = trainer.collector.collect(0).data  # re-scored at the sampling weights: ratio exactly 1
    steps = rollout.sde_steps
    assert rollout.images.shape == (4, 3, 5, 32, 32) and rollout.latents.shape[2:] == (16, 2, 4, 4)
    assert torch.equal(policy.log_prob(rollout, steps.expand(len(rollout), -1)), rollout.log_probs[:, steps])
    before = [p.detach().clone() for p in trainer.params]
    record = trainer.train_epoch(0)
    assert record["optimizer_steps"] == 2 and math.isfinite(float(record["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))
    assert all(torch.isfinite(p).all() for p in trainer.params)


def test_tensorboard_gets_videos_or_frame_strips():
    from flowrl.tracking import add_samples
    from flowrl.video import tensorboard_videos

    calls = []

    class Writer:
        def add_video(self, tag, video, step, fps):
            calls.append(("video", tuple(video.shape)))

        def add_images(self, tag, images, step):
            calls.append(("images", tuple(images.shape)))

    add_samples(Writer(), "samples", torch.rand(2, 3, 5, 64, 64), 1)
    add_samples(Writer(), "samples", torch.rand(2, 3, 64, 64), 1)
    first = ("video", (2, 5, 3, 64, 64)) if tensorboard_videos() else ("images", (2, 3, 128, 2 * (5 * 66 - 2)))
    assert calls == [first, ("images", (2, 3, 128, 128))]
