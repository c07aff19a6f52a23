"""Qwen-Image 2.1 beyond the registry contract (`test_families.py`): a sample does not depend on the prompts batched
with it (the pipeline's batches do: the image's rotary positions follow the padded text), a prompt longer than
`text_tokens` is refused (the pipeline truncates nothing), sizes off the pipeline's 32-pixel grid are refused."""

import pytest
import torch

from flowrl.models.families.qwen_image_21 import QwenImage21Adapter
from flowrl.policies import DiffusionPolicy


pytestmark = pytest.mark.models
OPTIONS = {"text_tokens": 32}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_a_prompt_s_image_does_not_depend_on_its_batch_but_the_pipeline_s_does():
    pipe = QwenImage21Adapter.tiny(seed=1)
    policy = DiffusionPolicy.from_pipeline(pipe, options=OPTIONS, forward_batch_size=1)
    noise = policy.adapter.initial_latents(2, 64, 64, _gen())
    kwargs = dict(num_steps=3, guidance_scale=1.0, sampler="ode", height=64, width=64)
    alone = policy.rollout(["a cat"], latents=noise[:1], **kwargs).images
    batched = policy.rollout(["a cat", "a red car dog"], latents=noise, **kwargs).images
    assert torch.equal(batched[0], alone[0])
    lengths = policy.encode(["a cat", "a red car dog"])["prompt_lengths"]
    assert lengths[0] < lengths[1]  # the two prompts have different token counts
    call = dict(height=64, width=64, num_inference_steps=3, output_type="pt", use_kv_cache=False)
    theirs_alone = pipe(prompt=["a cat"], latents=noise[:1].clone(), **call).images[:, :3]
    theirs_batched = pipe(prompt=["a cat", "a red car dog"], latents=noise.clone(), **call).images[:, :3]
    torch.testing.assert_close(theirs_alone[0], alone[0], rtol=0, atol=1e-5)  # flowrl's is the pipeline's alone
    assert (theirs_batched[0] - theirs_alone[0]).abs().max() > 1e-3  # padded in a batch, the pipeline's changes


def test_a_prompt_longer_than_text_tokens_is_refused():
    policy = DiffusionPolicy.from_pipeline(QwenImage21Adapter.tiny(seed=1), options={"text_tokens": 12})
    assert policy.encode(["a cat"])["prompt_lengths"].tolist() == [
        11
    ]  # the user turn's 3 tokens, 3 for the prompt, 5 after it
    with pytest.raises(ValueError, match=r"'a red dog' needs 13 text tokens, more than model.options.text_tokens=12$"):
        policy.encode(["a red dog"])


def test_sizes_off_the_32_pixel_grid_are_refused():
    policy = DiffusionPolicy.from_pipeline(QwenImage21Adapter.tiny(seed=1), options=OPTIONS)
    with pytest.raises(ValueError, match="multiples of 32 pixels, got 48 x 64$"):
        policy.rollout(["a cat"], num_steps=2, height=48, width=64, generator=_gen())
