"""Qwen-Image-Edit and Qwen-Image-Edit-Plus through flowrl: the source images reach the VAE tokens and the text
encoder (the negative prompt's too), several sources per prompt (Plus), exact re-scoring, and the processor that
needs no torchvision. (The checks every family passes run in tests/models/test_families.py.)"""

import pytest
import torch
from PIL import Image

from flowrl.models.families import MODEL_FAMILIES
from flowrl.models.families.qwen_image_edit import load_processor
from flowrl.policies import DiffusionPolicy, DiffusionRollout
from flowrl.policies.sources import NEGATIVE
from flowrl.prompts.edit_shapes import draw


pytestmark = pytest.mark.models

PROMPTS = ["make the square red", "make the circle blue"]
OPTIONS = {"max_sequence_length": 64}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _small_sources(small_edit_sources):
    """The pipelines' size rules at toy sizes (tests/conftest.py's `small_edit_sources`), for both sides."""


@pytest.fixture(scope="module")
def sources():
    return [draw("square", "blue", (10, 12, 40, 42)), draw("circle", "green", (20, 8, 52, 40))]


@pytest.fixture(scope="module")
def pipes():
    built = {f: MODEL_FAMILIES.get(f).tiny(seed=7) for f in ("qwen_image_edit", "qwen_image_edit_plus")}
    for pipe in built.values():
        pipe.set_progress_bar_config(disable=True)
    return built


def _pipeline(pipe, prompt, image, latents, guidance):
    return pipe(
        prompt=[prompt],
        image=image,
        height=64,
        width=64,
        num_inference_steps=4,
        true_cfg_scale=guidance,
        negative_prompt=[""],
        output_type="pt",
        latents=latents,
    ).images


@pytest.mark.parametrize("family", ["qwen_image_edit", "qwen_image_edit_plus"])
def test_the_negative_prompt_sees_the_sources_as_in_the_pipeline(family, pipes, sources):
    """Under true CFG the unconditional branch is the empty prompt shown with the pair's source: the rollout equals
    the pipeline's; with the text-only negative prompt it would not."""
    pipe = pipes[family]
    policy = DiffusionPolicy.from_pipeline(pipe, options=OPTIONS)
    latents = policy.adapter.initial_latents(2, 64, 64, _gen())
    kwargs = dict(
        num_steps=4, guidance_scale=4.0, sampler="ode", latents=latents, height=64, width=64, source_images=sources
    )
    rollout = policy.rollout(PROMPTS, **kwargs)
    expected = torch.cat(
        [_pipeline(pipe, p, s, latents[i : i + 1], 4.0) for i, (p, s) in enumerate(zip(PROMPTS, sources))]
    )
    torch.testing.assert_close(rollout.images, expected, rtol=0, atol=1e-5)
    assert {NEGATIVE + "prompt_embeds", NEGATIVE + "prompt_embeds_mask"} <= set(rollout.edit_cond)
    assert not torch.equal(*rollout.edit_cond[NEGATIVE + "prompt_embeds"])  # one per source
    blind = DiffusionPolicy.from_pipeline(pipe, options=OPTIONS)
    encode = blind.adapter.encode_source_text

    def blank_negative(prompt, inputs):  # the negative prompt shown a black image instead of the source
        vision = [Image.new("RGB", image.size) for image in inputs[0]] if prompt == "" else inputs[0]
        return encode(prompt, (vision, inputs[1]))

    blind.adapter.encode_source_text = blank_negative
    assert (blind.rollout(PROMPTS, **kwargs).images - expected).abs().max() > 1e-4


def test_plus_takes_several_sources_per_prompt(pipes, sources):
    pipe = pipes["qwen_image_edit_plus"]
    policy = DiffusionPolicy.from_pipeline(pipe, options=OPTIONS)
    latents = policy.adapter.initial_latents(1, 64, 64, _gen())
    rollout = policy.rollout(
        PROMPTS[:1],
        num_steps=4,
        guidance_scale=4.0,
        sampler="ode",
        latents=latents,
        height=64,
        width=64,
        source_images=[sources],
    )
    expected = _pipeline(pipe, PROMPTS[0], sources, latents, 4.0)
    torch.testing.assert_close(rollout.images, expected, rtol=0, atol=1e-5)
    assert rollout.source_images.shape == (1, 2, 3, 64, 64)
    assert rollout.edit_cond["image_shapes"].tolist() == [[[1, 8, 8], [1, 8, 8]]]  # each source's latent grid
    one = policy.rollout(
        PROMPTS[:1],
        num_steps=4,
        guidance_scale=4.0,
        sampler="ode",
        latents=latents,
        height=64,
        width=64,
        source_images=[sources[:1]],
    ).images
    assert (one - rollout.images).abs().max() > 1e-3  # the second source changed the edit


def test_the_sde_rollout_rescores_exactly_in_chunks_after_cat_and_select(pipes, sources):
    policy = DiffusionPolicy.from_pipeline(pipes["qwen_image_edit_plus"], options=OPTIONS, forward_batch_size=2)
    entries = [sources, sources[::-1], sources, sources[::-1]]  # two sources each, in either order
    prompts = PROMPTS + ["make it green", PROMPTS[1]]
    parts = [
        policy.rollout(
            prompts[i : i + 2],
            num_steps=4,
            guidance_scale=4.0,
            sampler="flow_sde",
            noise_level=0.8,
            generator=_gen(i),
            height=64,
            width=64,
            source_images=entries[i : i + 2],
        )
        for i in (0, 2)
    ]
    rollout = DiffusionRollout.cat(parts)
    steps = rollout.sde_steps
    assert torch.equal(policy.log_prob(rollout, steps.expand(4, -1)), rollout.log_probs[:, steps])
    picked = rollout.select([3, 0])
    assert torch.equal(policy.log_prob(picked, steps.expand(2, -1)), picked.log_probs[:, steps])
    # rows 1 and 3 share prompt and sources (one group); the order of the sources makes another pair
    assert rollout.group_ids.tolist() == [0, 1, 2, 1] and len(rollout.edit_keys) == 3


def test_a_pair_s_conditioning_does_not_depend_on_its_batch(pipes, sources):
    alone = DiffusionPolicy.from_pipeline(pipes["qwen_image_edit"], options=OPTIONS)
    batched = DiffusionPolicy.from_pipeline(pipes["qwen_image_edit"], options=OPTIONS)
    a = alone.encode_edits([PROMPTS[0]], [sources[0]])
    b = batched.encode_edits(["x", PROMPTS[0], "a longer prompt than the others"], [sources[1], *sources[:1] * 2])
    assert set(a.cond) == set(b.cond)
    for key in a.cond:
        assert torch.equal(a.cond[key][0], b.cond[key][b.ids[1]]), key


def test_bad_inputs_fail_in_one_line(pipes, sources):
    policy = DiffusionPolicy.from_pipeline(pipes["qwen_image_edit"], options=OPTIONS)
    with pytest.raises(ValueError, match="qwen_image_edit edits one source image per prompt, got 2"):
        policy.encode_edits(["x"], [sources])
    short = DiffusionPolicy.from_pipeline(pipes["qwen_image_edit"], options={"max_sequence_length": 4})
    with pytest.raises(ValueError, match=r"needs \d+ text tokens, more than model.options.max_sequence_length=4$"):
        short.encode_edits([PROMPTS[0]], [sources[0]])
    with pytest.raises(ValueError, match="vision_size must be"):
        MODEL_FAMILIES.get("qwen_image_edit").make_options({"vision_size": [16]})


def test_the_processor_loads_without_a_video_processor(pipes, tmp_path):
    """The saved folder names transformers' `Qwen2VLProcessor` (a diffusers user with torchvision loads it as it is);
    flowrl loads its tokenizer and image processor alone, with the same outputs."""
    import json

    pipes["qwen_image_edit"].save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["processor"] == ["transformers", "Qwen2VLProcessor"]
    processor = load_processor(str(tmp_path))
    assert not hasattr(processor, "video_processor") or processor.video_processor is None
    text = "Picture 1: <|vision_start|><|image_pad|><|vision_end|>make it red"
    image = draw("square", "blue", (10, 12, 40, 42))
    ours = processor(text=[text], images=[image], return_tensors="pt")
    theirs = pipes["qwen_image_edit"].processor(text=[text], images=[image], return_tensors="pt")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
