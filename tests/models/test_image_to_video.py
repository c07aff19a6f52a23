"""Image-to-video families beyond the registry contract (`test_families.py` runs each family's default tiny
pipeline): Wan 2.2 I2V-A14B's two experts and TI2V-5B's start frame held in the state, against
`WanImageToVideoPipeline`; the start frame is a conditioning image, as an edit's source."""

import numpy as np
import pytest
import torch

from flowrl.models.families.wan_i2v import WanI2VAdapter
from flowrl.policies import DiffusionPolicy
from flowrl.prompts.edit_shapes import draw


pytestmark = pytest.mark.models
OPTIONS = {"num_frames": 5, "max_sequence_length": 16}
PROMPTS = ["a cat", "a dog", "a cat"]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _start():
    return draw("circle", "red", (12, 10, 40, 38))


@pytest.mark.parametrize("variant", ["2.2", "ti2v"])
def test_wan_i2v_variants_reproduce_the_pipeline_and_rescore_exactly(variant):
    pipe = WanI2VAdapter.tiny(seed=3, variant=variant)
    pipe.set_progress_bar_config(disable=True)
    policy = DiffusionPolicy.from_pipeline(pipe, options=OPTIONS)
    sources = [_start()] * len(PROMPTS)
    rollout = policy.rollout(
        PROMPTS,
        num_steps=4,
        guidance_scale=3.5,
        sampler="ode",
        generator=_gen(),
        height=64,
        width=64,
        source_images=sources,
    )
    frames = pipe(
        prompt=PROMPTS,
        image=sources[0],
        height=64,
        width=64,
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=3.5,
        generator=_gen(),
        output_type="pt",
        max_sequence_length=16,
    ).frames
    torch.testing.assert_close(rollout.images, frames.transpose(1, 2), rtol=0, atol=1e-5)
    sde = policy.rollout(
        PROMPTS,
        num_steps=4,
        guidance_scale=3.5,
        noise_level=0.8,
        generator=_gen(1),
        height=64,
        width=64,
        source_images=sources,
    )
    steps = sde.sde_steps.expand(len(PROMPTS), -1)
    assert torch.equal(policy.log_prob(sde, steps), sde.log_probs[:, sde.sde_steps])
    start = torch.from_numpy(np.array(_start())).permute(2, 0, 1).float() / 255
    assert sde.source_images.shape == (
        3,
        1,
        3,
        64,
        64,
    )  # what rewards compare with: the start frame as the model saw it
    torch.testing.assert_close(sde.source_images[:, 0], start.expand(3, -1, -1, -1), rtol=0, atol=1e-6)


def test_ti2v_keeps_the_start_frame_latent_and_scores_only_the_generated_frames():
    """TI2V-5B: the state's first latent frame is the start image's latent at every step (no noise on it, velocity
    0), and the log-probability is the Gaussian's over the other frames' elements alone."""
    pipe = WanI2VAdapter.tiny(seed=3, variant="ti2v")
    policy = DiffusionPolicy.from_pipeline(pipe, options=OPTIONS)
    rollout = policy.rollout(
        ["a cat"] * 2,
        num_steps=3,
        guidance_scale=1.0,
        noise_level=0.9,
        generator=_gen(2),
        height=64,
        width=64,
        source_images=[_start()] * 2,
        store_means=True,
    )
    start = rollout.edit_cond["condition"][0]  # [C, 1, h, w]
    for t in range(rollout.latents.shape[1]):
        assert torch.equal(rollout.latents[:, t, :, :1], start.expand(2, -1, -1, -1, -1))
    assert not torch.equal(rollout.latents[:, 1, :, 1:], rollout.latents[:, 0, :, 1:])
    # the log-prob of step 0 by hand, over the generated frames' elements only (flow_sde, mean reduction)
    x, x1 = rollout.latents[:, 0, :, 1:].float(), rollout.latents[:, 1, :, 1:].float()
    mean = rollout.means[:, 0].float()
    assert mean.shape == (2, x[0].numel())
    std = rollout.stds[0]
    by_hand = (
        -((x1.flatten(1) - mean) ** 2).mean(1) / (2 * std**2)
        - torch.log(std)
        - 0.5 * torch.log(torch.tensor(2 * torch.pi))
    )
    torch.testing.assert_close(rollout.log_probs[:, 0], by_hand, rtol=1e-6, atol=1e-6)


def test_a_start_image_is_required_and_prepared_at_the_video_size():
    policy = DiffusionPolicy.from_pipeline(WanI2VAdapter.tiny(seed=3), options=OPTIONS)
    with pytest.raises(ValueError, match="needs a start image"):
        policy.rollout(["a cat"], num_steps=2, height=64, width=64, generator=_gen())
    rollout = policy.rollout(
        ["a cat"], num_steps=2, height=48, width=32, generator=_gen(), guidance_scale=1.0, source_images=[_start()]
    )
    assert rollout.source_pixels.shape == (1, 1, 3, 48, 32) and rollout.images.shape == (1, 3, 5, 48, 32)
    with pytest.raises(ValueError, match="divisible by 16"):
        policy.rollout(["a cat"], num_steps=2, height=40, width=32, source_images=[_start()])
