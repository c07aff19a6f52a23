"""Every registered model family (`flowrl.models.families`) on its own tiny offline pipeline: what a family must
give the rest of flowrl. A new family is its module plus nothing here: these tests run over the registry."""

import dataclasses

import pytest
import torch

from flowrl.models import detect_family, load_pipeline
from flowrl.models.families import MODEL_FAMILIES, family_options
from flowrl.policies import DiffusionPolicy
from flowrl.policies.adapters import adapter_for


FAMILIES = MODEL_FAMILIES.names()
PROMPTS = ["a cat", "a dog", "a cat", "a red car"]
GUIDANCE = 3.5
"""With classifier-free guidance (or, Flux, its guidance embedding) on."""


def _options(family) -> dict:
    """Short T5 prompts where the family has that option."""
    fields = {f.name for f in dataclasses.fields(MODEL_FAMILIES.get(family).Options)}
    options = {"max_sequence_length": 16} if "max_sequence_length" in fields else {}
    return {**options, "num_frames": 5} if "num_frames" in fields else options  # video families: 5 frames


def _pixels(output) -> torch.Tensor:
    """A pipeline's `output_type="pt"` result in flowrl's layout: images `[B, 3, H, W]`, or a video pipeline's
    frames `[B, F, 3, H, W]` as videos `[B, 3, F, H, W]`."""
    return output.images if hasattr(output, "images") else output.frames.transpose(1, 2)


def _guidance(family, batch_size, pipe=None) -> dict:
    """The pipeline's arguments for flowrl's `guidance_scale=GUIDANCE` and empty negative prompt (most pipelines:
    `guidance_scale`; Qwen-Image: `true_cfg_scale` and a negative prompt per image), at flowrl's 64 x 64 (FLUX.1
    Kontext: `max_area`); `pipe`, when given, is set to guide at that scale where a component holds it
    (HunyuanVideo 1.5: its `guider`)."""
    cls = MODEL_FAMILIES.get(family)
    if pipe is not None:
        cls.set_pipeline_guidance(pipe, GUIDANCE)
    return {**cls.pipeline_call_kwargs(GUIDANCE, batch_size), **cls.pipeline_size_kwargs(64, 64)}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """`(family name, its tiny pipeline)`."""
    pipe = MODEL_FAMILIES.get(request.param).tiny(seed=7)
    pipe.set_progress_bar_config(disable=True)
    return request.param, pipe


def test_the_tiny_pipeline_is_the_family_s_pipeline_and_finds_its_adapter(family, tmp_path):
    name, pipe = family
    cls = MODEL_FAMILIES.get(name)
    assert type(pipe).__name__ == cls.pipeline_class
    adapter = adapter_for(pipe, _options(name))
    assert type(adapter) is cls and adapter.family == name
    assert adapter.default_sampler in ("flow_sde", "ddim") and cls.lora_targets
    pipe.save_pretrained(tmp_path)
    assert detect_family(tmp_path) == name and type(load_pipeline(tmp_path)).__name__ == cls.pipeline_class


def test_options_are_validated_by_the_family(family):
    name, _ = family
    with pytest.raises(ValueError, match="no_such_option"):
        family_options(name, {"no_such_option": 1})
    assert dataclasses.is_dataclass(family_options(name, _options(name)))


def test_ode_rollout_reproduces_the_diffusers_pipeline(family):
    name, pipe = family
    policy = DiffusionPolicy.from_pipeline(pipe, options=_options(name))
    rollout = policy.rollout(PROMPTS, num_steps=4, guidance_scale=GUIDANCE, sampler="ode", generator=_gen(),
                             height=64, width=64)  # fmt: skip
    images = pipe(prompt=list(PROMPTS), height=64, width=64, num_inference_steps=4, output_type="pt", generator=_gen(),
                  **_guidance(name, len(PROMPTS), pipe), **_options(name))  # fmt: skip
    images = _pixels(images)
    assert rollout.images.shape[:2] == (4, 3) and rollout.images.shape[-2:] == (64, 64)
    assert rollout.images.shape == images.shape
    assert 0 <= rollout.images.min() and rollout.images.max() <= 1
    torch.testing.assert_close(rollout.images, images, rtol=0, atol=1e-5)
    assert not rollout.sde_mask.any() and torch.all(rollout.log_probs == 0)


def test_the_default_sampler_rescores_exactly(family):
    """The ratio is exactly 1 at the old weights with the family's own sampler."""
    name, pipe = family
    policy = DiffusionPolicy.from_pipeline(pipe, options=_options(name))
    sampler = MODEL_FAMILIES.get(name).default_sampler
    rollout = policy.rollout(PROMPTS, num_steps=4, guidance_scale=GUIDANCE, sampler=sampler, noise_level=0.8,
                             generator=_gen(1), height=64, width=64)  # fmt: skip
    steps = rollout.sde_steps
    assert len(steps) >= 3
    assert torch.equal(policy.log_prob(rollout, steps.expand(4, -1)), rollout.log_probs[:, steps])


def test_lora_round_trip_through_diffusers_load_lora_weights(family, tmp_path):
    name, _ = family
    build = MODEL_FAMILIES.get(name).tiny
    policy = DiffusionPolicy.from_pipeline(build(seed=7), options=_options(name))
    policy.add_lora(rank=4, alpha=8)
    assert policy.trainable_parameters() and all("lora" in n for n, p in policy.model.named_parameters()
                                                  if p.requires_grad)  # fmt: skip
    with torch.no_grad():  # stand-in for a trained adapter
        for param_name, param in policy.model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0, 0.05)
    trained = policy.rollout(["a cat", "a dog"], num_steps=3, guidance_scale=GUIDANCE, sampler="ode",
                             generator=_gen(), height=64, width=64).images  # fmt: skip
    path = policy.save_lora(tmp_path)
    assert path.name == "pytorch_lora_weights.safetensors" and path.is_file()
    fresh = build(seed=7)
    fresh.set_progress_bar_config(disable=True)
    kwargs = dict(height=64, width=64, num_inference_steps=3, output_type="pt", **_guidance(name, 2, fresh),
                  **_options(name))  # fmt: skip
    base = _pixels(fresh(prompt=["a cat", "a dog"], generator=_gen(), **kwargs))
    MODEL_FAMILIES.get(name).load_lora_into(fresh, tmp_path)  # `load_lora_weights`, or the family's `lora_loader`
    loaded = _pixels(fresh(prompt=["a cat", "a dog"], generator=_gen(), **kwargs))
    torch.testing.assert_close(loaded, trained, rtol=0, atol=1e-5)
    assert (base - trained).abs().max() > 1e-3  # the adapter did change the outputs
    again = DiffusionPolicy.from_pipeline(build(seed=7), options=_options(name))
    again.load_lora(tmp_path)
    assert torch.equal(again.rollout(["a cat", "a dog"], num_steps=3, guidance_scale=GUIDANCE, sampler="ode",
                                     generator=_gen(), height=64, width=64).images, trained)  # fmt: skip
