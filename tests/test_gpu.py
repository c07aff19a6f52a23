"""GPU checks (opt in with `pytest -m gpu` on a CUDA machine): bf16 models, exact re-scoring, a training epoch."""

import pytest
import torch

from flowrl.models import tiny_flux, tiny_sd3
from flowrl.models.families import MODEL_FAMILIES
from flowrl.policies import DiffusionPolicy
from flowrl.prompts.edit_shapes import draw

from .conftest import TEXT


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("build, guidance", [(tiny_sd3, 4.5), (tiny_flux, 3.5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rollouts_rescore_exactly_on_cuda(build, guidance, dtype):
    pipe = build().to("cuda", dtype)
    policy = DiffusionPolicy.from_pipeline(pipe, **TEXT)
    g = torch.Generator("cuda").manual_seed(0)
    rollout = policy.rollout(
        ["a cat", "a dog", "a cat"], num_steps=4, guidance_scale=guidance, generator=g, height=64, width=64
    )
    assert rollout.latents.dtype == dtype and rollout.log_probs.dtype == torch.float32
    steps = rollout.sde_steps
    assert torch.equal(policy.log_prob(rollout, steps.expand(3, -1)), rollout.log_probs[:, steps])
    one = rollout.select([1])
    assert torch.equal(policy.log_prob(one, steps.expand(1, -1)), one.log_probs[:, steps])


NEEDS = {"ltx2_i2v": "av", "wan_i2v": "ftfy"}
"""The video extra's packages a family's pipeline imports (H.264 re-compression of LTX-2's start image; Wan I2V's
prompt cleaning)."""


@pytest.mark.parametrize("family", MODEL_FAMILIES.names())
def test_every_family_rescores_exactly_in_bf16_on_cuda(family):
    if family in NEEDS:
        pytest.importorskip(NEEDS[family])
    cls = MODEL_FAMILIES.get(family)
    fields = cls.Options.__dataclass_fields__
    options = {k: v for k, v in {"max_sequence_length": 16, "num_frames": 5}.items() if k in fields}
    # loaded as a run loads it: bf16 except the modules the network keeps in fp32 (Kandinsky 5's time embedding)
    policy = DiffusionPolicy.from_pretrained(f"tiny:{family}@2", dtype=torch.bfloat16, device="cuda", options=options)
    g = torch.Generator("cuda").manual_seed(0)
    start = cls.conditioning == "start_frame"  # image-to-video: a start frame with each prompt
    sources = {"source_images": [draw("square", "blue", (10, 12, 40, 42))] * 3} if start else {}
    rollout = policy.rollout(
        ["a cat", "a dog", "a cat"],
        num_steps=4,
        guidance_scale=3.5,
        generator=g,
        height=64,
        width=64,
        sampler=cls.default_sampler,
        noise_level=0.8,
        **sources,
    )
    steps = rollout.sde_steps
    assert len(steps) >= 3 and rollout.log_probs.dtype == torch.float32
    assert torch.equal(policy.log_prob(rollout, steps.expand(3, -1)), rollout.log_probs[:, steps])


def test_lora_training_epoch_on_cuda(tmp_path):
    from flowrl.trainers import build_trainer, load_config

    pipe = tiny_sd3().to("cuda", torch.bfloat16)
    pipe.save_pretrained(tmp_path / "sd3")
    config = load_config(
        {
            "trainer": "grpo_guard",
            "model": {"name": str(tmp_path / "sd3"), "dtype": "bf16", "lora_rank": 4, "options": TEXT},
            "sampling": {"num_steps": 3, "height": 64, "width": 64},
            "batch": {"mini_batch_size": 8, "micro_batch_size": 4},
            "prompts": {"train": "simple_animals", "test": "simple_animals", "prompts_per_epoch": 2, "group_size": 4},
            "rewards": [{"name": "jpeg_compressibility"}],
            "eval": {"every": 0, "samples_per_prompt": 1, "max_prompts": 2},
            "run": {"epochs": 1, "log_with": [], "mixed_precision": "bf16", "output_dir": str(tmp_path / "run")},
        }
    )
    trainer = build_trainer(config)
    assert trainer.engine.accelerator.device.type == "cuda"
    before = [p.detach().clone() for p in trainer.params]
    record = trainer.train_epoch(0)
    assert torch.isfinite(torch.tensor(float(record["loss"])))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))
    assert all(p.dtype == torch.float32 for p in trainer.params)  # the adapter trains in fp32


def test_a_rollout_and_an_update_step_never_wait_for_the_gpu(tmp_path):
    # every device-to-host read and blocking copy in the denoising loops raises under CUDA's sync debug mode; the
    # rollout's and the update's loops run inside it (the optimizer step reads its gradient norm: outside)
    from flowrl.policies.rollout import Collected
    from flowrl.run.stats import EpochStats
    from flowrl.trainers import build_trainer, load_config

    pipe = tiny_sd3().to("cuda", torch.bfloat16)
    pipe.save_pretrained(tmp_path / "sd3")
    config = load_config(
        {
            "trainer": "grpo_guard",
            "model": {"name": str(tmp_path / "sd3"), "dtype": "bf16", "lora_rank": 4, "options": TEXT},
            "sampling": {"num_steps": 3, "height": 64, "width": 64},
            "batch": {"mini_batch_size": 4, "micro_batch_size": 2},
            "prompts": {"train": "simple_animals", "test": "simple_animals", "prompts_per_epoch": 1, "group_size": 4},
            "rewards": [{"name": "jpeg_compressibility"}],
            "eval": {"every": 0, "samples_per_prompt": 1, "max_prompts": 1},
            "run": {"epochs": 1, "log_with": [], "mixed_precision": "bf16", "output_dir": str(tmp_path / "run")},
        }
    )
    trainer = build_trainer(config)
    assert trainer.engine.optimizer.defaults.get("fused") and torch.backends.cuda.matmul.allow_tf32
    sampler, scheduler = trainer.algorithm.sampler(), trainer.scheduler
    generators = [torch.Generator("cuda").manual_seed(i) for i in range(4)]
    trainer.policy.encode(["a cat", trainer.policy.negative_prompt])  # text encoding reads masks: before
    torch.cuda.set_sync_debug_mode("error")
    try:
        rollout = sampler(["a cat"] * 4, generators, [0, 1, 2, 3], 0)
        collected = Collected(
            data=rollout,
            rows=torch.arange(4),
            size=4,
            prompts=["a cat"] * 4,
            total=torch.zeros(4),
            group_ids=torch.zeros(4, dtype=torch.long),
        )
        batch, _ = trainer.algorithm.prepare(collected, torch.linspace(-1, 1, 4), torch.ones(4, dtype=torch.bool), 0)
        plan = scheduler.plan(batch, 0)
        trainer.engine.model.train()
        scheduler.accumulate(plan, torch.arange(4), EpochStats())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert any(p.grad is not None for p in trainer.params)  # (on CPUs: tests/policies/test_no_sync.py)


def test_prompts_encode_before_a_network_too_big_to_share_the_gpu_moves_there(tmp_path):
    # model.offload_text_encoders: the text encoders come to the GPU for the prompts while the network waits in CPU
    # memory; then the network moves and the encoders go back to CPU memory
    from flowrl.image.modality import build_image_policy
    from flowrl.models import ModelConfig

    tiny_sd3().save_pretrained(tmp_path / "sd3")
    model = ModelConfig(name=str(tmp_path / "sd3"), lora_rank=4, offload_text_encoders=True, options=TEXT)
    policy = build_image_policy(model, forward_batch_size=2, device="cuda", prompts=["a cat", "a dog"])
    assert policy.model.device.type == "cuda" and policy.adapter.pipeline.vae.device.type == "cuda"
    assert all(p.device.type == "cpu" for p in policy.adapter.pipeline.text_encoder_3.parameters())
    assert policy.encode(["a cat"])["prompt_embeds"].device.type == "cuda"
