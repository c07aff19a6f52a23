"""Kandinsky 5 beyond the registry contract (`test_families.py`): a prompt's sample does not depend on the prompts
batched with it (the pipeline pads a batch to its longest prompt, unmasked; flowrl runs each text length apart), and a
`visual_cond` transformer's conditioning channels stay zero in the state, out of the log-probability."""

import pytest
import torch

from flowrl.models.families.kandinsky5 import Kandinsky5Adapter
from flowrl.policies import DiffusionPolicy


pytestmark = pytest.mark.models
OPTIONS = {"num_frames": 5, "max_sequence_length": 16}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_a_prompt_s_video_does_not_depend_on_its_batch():
    policy = DiffusionPolicy.from_pipeline(Kandinsky5Adapter.tiny(seed=1), options=OPTIONS, forward_batch_size=1)
    noise = policy.adapter.initial_latents(2, 64, 64, _gen())
    kwargs = dict(num_steps=3, guidance_scale=3.0, sampler="ode", height=64, width=64)
    alone = policy.rollout(["a cat"], latents=noise[:1], **kwargs).images
    batched = policy.rollout(["a cat", "a red car dog"], latents=noise, **kwargs).images
    assert torch.equal(batched[0], alone[0])
    lengths = policy.encode(["a cat", "a red car dog"])["prompt_lengths"]
    assert lengths[0] < lengths[1]  # the two prompts have different token counts


def test_the_visual_conditioning_channels_stay_zero_and_out_of_the_log_prob():
    policy = DiffusionPolicy.from_pipeline(Kandinsky5Adapter.tiny(seed=1), options=OPTIONS)
    rollout = policy.rollout(
        ["a cat"] * 2,
        num_steps=3,
        guidance_scale=1.0,
        noise_level=0.9,
        generator=_gen(2),
        height=64,
        width=64,
        store_means=True,
    )
    channels = policy.model.config.out_visual_dim
    assert rollout.latents.shape[-1] == 2 * channels + 1  # latents, zero conditioning latents, zero mask
    assert (rollout.latents[..., channels:] == 0).all()
    assert rollout.means.shape[-1] == rollout.latents[:, 0, ..., :channels].numel() // 2
