"""Every registered model family (`flowrl.models.families`) on its own tiny offline pipeline: what a family must
give the rest of flowrl. A new family is its module plus nothing here: these tests run over the registry."""

import dataclasses
import inspect

import pytest
import torch

from flowrl.models import detect_family, load_pipeline
from flowrl.models.families import MODEL_FAMILIES, adapter_for, family_options
from flowrl.policies import DiffusionPolicy


FAMILIES = MODEL_FAMILIES.names()
PROMPTS = ["a cat", "a dog", "a cat", "a red car"]
GUIDANCE = 3.5
"""With classifier-free guidance (or, Flux, its guidance embedding) on."""


def _options(family) -> dict:
    """Short T5 prompts where the family has that option."""
    cls = MODEL_FAMILIES.get(family)
    fields = {f.name for f in dataclasses.fields(cls.Options)}
    length = 32 if cls.pipeline_needs_sources else 16  # (Qwen-Image-Edit-Plus: "Picture 1: " and its delimiters)
    options = {"max_sequence_length": length} if "max_sequence_length" in fields else {}
    return {**options, "num_frames": 5} if "num_frames" in fields else options  # video families: 5 frames


def _pixels(output, family) -> torch.Tensor:
    """A pipeline's `output_type="pt"` result in flowrl's layout: RGB images `[B, 3, H, W]` (the family's
    `pipeline_output`; Qwen-Image 2.1's RGBA without alpha), or a video pipeline's frames `[B, F, 3, H, W]` as
    videos `[B, 3, F, H, W]`."""
    cls = MODEL_FAMILIES.get(family)
    return output.frames.transpose(1, 2) if cls.video else getattr(output, cls.pipeline_output)[:, :3]


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


def _sources(family, n) -> dict:
    """`source_images` for `n` prompts where the family's pipeline refuses a call without one (else nothing)."""
    if not MODEL_FAMILIES.get(family).pipeline_needs_sources:
        return {}
    from flowrl.prompts.edit_shapes import draw

    return {"source_images": [draw("square", "blue", (10, 12, 40, 42))] * n}


@pytest.fixture(autouse=True)
def _small_sources(small_edit_sources):
    """Qwen-Image-Edit's sources at toy sizes in every test here (tests/conftest.py's `small_edit_sources`)."""


def _pipeline_images(family, pipe, prompts, latents, **kwargs) -> torch.Tensor:
    """The pipeline's images from `_gen()` (the rollout's generator), or where the family needs source images, from
    the rollout's initial `latents` with them (one call per prompt: Qwen-Image-Edit-Plus's pipeline takes one
    prompt per call)."""
    sources = _sources(family, len(prompts)).get("source_images")
    if getattr(MODEL_FAMILIES.get(family), "pipeline_pads_prompts", False):  # its batches depend on their prompts:
        guided = {**kwargs, **_guidance(family, 1)}  # (.clone(): the pipeline steps the latents in place)
        calls = [pipe(prompt=[p], latents=latents[i : i + 1].clone(), **guided) for i, p in enumerate(prompts)]
        return torch.cat([_pixels(c, family) for c in calls])
    if sources is None:
        return _pixels(pipe(prompt=list(prompts), generator=_gen(), **kwargs), family)
    if MODEL_FAMILIES.get(family).conditioning == "start_frame":  # image-to-video: one start image for the batch
        if "height" not in inspect.signature(pipe.__call__).parameters:  # HunyuanVideo 1.5: the size of the image's
            kwargs = {k: v for k, v in kwargs.items() if k not in ("height", "width")}  # bucket (64 x 64 here)
        return _pixels(pipe(prompt=list(prompts), image=sources[0], generator=_gen(), **kwargs), family)
    calls = [
        pipe(prompt=[p], image=s, latents=latents[i : i + 1], **{**kwargs, **_guidance(family, 1)})
        for i, (p, s) in enumerate(zip(prompts, sources))
    ]
    return torch.cat([_pixels(c, family) for c in calls])


TIERED = [f if f in ("sd3", "flux", "unet") else pytest.param(f, marks=pytest.mark.models) for f in FAMILIES]
"""A flow transformer, a guidance-embedding one and a DDIM UNet in the default tier; every other family runs these
checks in the `models` tier (`.ci/run`'s second step), as its export and gradient-checkpointing tests do."""


@pytest.fixture(scope="module", params=TIERED)
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
    rollout = policy.rollout(
        PROMPTS,
        num_steps=4,
        guidance_scale=GUIDANCE,
        sampler="ode",
        generator=_gen(),
        height=64,
        width=64,
        **_sources(name, len(PROMPTS)),
    )
    latents = policy.adapter.initial_latents(len(PROMPTS), 64, 64, _gen())  # the rollout's initial noise
    images = _pipeline_images(
        name,
        pipe,
        PROMPTS,
        latents,
        height=64,
        width=64,
        num_inference_steps=4,
        output_type="pt",
        **_guidance(name, len(PROMPTS), pipe),
        **_options(name),
    )
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
    rollout = policy.rollout(
        PROMPTS,
        num_steps=4,
        guidance_scale=GUIDANCE,
        sampler=sampler,
        noise_level=0.8,
        generator=_gen(1),
        height=64,
        width=64,
        **_sources(name, len(PROMPTS)),
    )
    steps = rollout.sde_steps
    assert len(steps) >= 3
    assert torch.equal(policy.log_prob(rollout, steps.expand(4, -1)), rollout.log_probs[:, steps])


def test_lora_round_trip_through_diffusers_load_lora_weights(family, tmp_path):
    name, _ = family
    build = MODEL_FAMILIES.get(name).tiny
    policy = DiffusionPolicy.from_pipeline(build(seed=7), options=_options(name))
    policy.add_lora(rank=4, alpha=8)
    assert policy.trainable_parameters() and all(
        "lora" in n for n, p in policy.model.named_parameters() if p.requires_grad
    )
    with torch.no_grad():  # stand-in for a trained adapter
        for param_name, param in policy.model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0, 0.05)
    prompts, sources = ["a cat", "a dog"], _sources(name, 2)
    trained = policy.rollout(
        prompts, num_steps=3, guidance_scale=GUIDANCE, sampler="ode", generator=_gen(), height=64, width=64, **sources
    ).images
    path = policy.save_lora(tmp_path)
    assert path.name == "pytorch_lora_weights.safetensors" and path.is_file()
    fresh = build(seed=7)
    fresh.set_progress_bar_config(disable=True)
    latents = policy.adapter.initial_latents(2, 64, 64, _gen())
    kwargs = dict(
        height=64, width=64, num_inference_steps=3, output_type="pt", **_guidance(name, 2, fresh), **_options(name)
    )
    base = _pipeline_images(name, fresh, prompts, latents, **kwargs)
    MODEL_FAMILIES.get(name).load_lora_into(fresh, tmp_path)  # `load_lora_weights`, or the family's `lora_loader`
    loaded = _pipeline_images(name, fresh, prompts, latents, **kwargs)
    torch.testing.assert_close(loaded, trained, rtol=0, atol=1e-5)
    assert (base - trained).abs().max() > 1e-3  # the adapter did change the outputs
    again = DiffusionPolicy.from_pipeline(build(seed=7), options=_options(name))
    again.load_lora(tmp_path)
    assert torch.equal(
        again.rollout(
            prompts,
            num_steps=3,
            guidance_scale=GUIDANCE,
            sampler="ode",
            generator=_gen(),
            height=64,
            width=64,
            **sources,
        ).images,
        trained,
    )
