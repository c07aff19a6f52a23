"""The `model` options every family takes: gradient checkpointing (same gradients, recomputed activations) and the
attention backend (diffusers' switch; the ratio stays exactly 1)."""

import pytest
import torch

from flowrl.models import ModelConfig
from flowrl.models.families import MODEL_FAMILIES
from flowrl.policies import DiffusionPolicy
from flowrl.policies.build import prepare_training
from flowrl.prompts.edit_shapes import draw


def _policy(family: str, **model):
    cls = MODEL_FAMILIES.get(family)
    length = 32 if cls.pipeline_needs_sources else 16  # (Qwen-Image-Edit-Plus: "Picture 1: " and its delimiters)
    options = {"max_sequence_length": length} if "max_sequence_length" in cls.Options.__dataclass_fields__ else {}
    policy = DiffusionPolicy.from_pipeline(cls.tiny(seed=3), options=options)
    return prepare_training(policy, ModelConfig(name="tiny", lora_rank=4, lora_alpha=8, **model))


def _grads(policy, rollout):
    policy.model.zero_grad(set_to_none=True)
    steps = rollout.sde_steps.expand(len(rollout.prompts), -1)
    logp = policy.log_prob(rollout, steps)
    (logp.float() * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "family",
    [f if f in ("sd3", "flux", "unet") else pytest.param(f, marks=pytest.mark.models) for f in MODEL_FAMILIES.names()],
)  # the others: the `models` tier
def test_gradient_checkpointing_gives_the_same_gradients(family, small_edit_sources):
    plain = _policy(family)
    kwargs = dict(
        num_steps=3,
        guidance_scale=1.0,
        noise_level=0.8,
        height=64,
        width=64,
        sampler=MODEL_FAMILIES.get(family).default_sampler,
    )
    if MODEL_FAMILIES.get(family).pipeline_needs_sources:  # editing and image-to-video: an image with each prompt
        kwargs["source_images"] = [draw("square", "blue", (10, 12, 40, 42))] * 2
    rollout = plain.rollout(["a cat", "a dog"], generator=torch.Generator().manual_seed(0), **kwargs)
    logp, grads = _grads(plain, rollout)
    checkpointed = _policy(family, gradient_checkpointing=True)
    assert checkpointed.model.is_gradient_checkpointing
    logp2, grads2 = _grads(checkpointed, rollout)
    assert grads and set(grads) == set(grads2)
    torch.testing.assert_close(logp2, logp, rtol=0, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_attention_backend_is_diffusers_switch_and_keeps_the_ratio_exact():
    policy = _policy("sd3", attention_backend="_native_math")
    rollout = policy.rollout(
        ["a cat", "a dog"],
        num_steps=3,
        guidance_scale=2.0,
        noise_level=0.8,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
    )
    steps = rollout.sde_steps.expand(2, -1)
    with torch.no_grad():
        assert torch.equal(policy.log_prob(rollout, steps), rollout.log_probs[:, rollout.sde_steps])
    with pytest.raises(ValueError, match="model.attention_backend 'flash_attn9' is not one of diffusers' backends"):
        ModelConfig(attention_backend="flash_attn9")
