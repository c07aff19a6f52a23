"""No host syncs in the denoising loops: a rollout and an update step run on `meta` tensors, which hold no data, so
any read of a device value on the host (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`) raises. The schedule is host
data and the step kernels mask zero-std rows instead of reading them (`flowrl.policies.sde`); on a GPU each such read
would wait for the device (tests/test_gpu.py runs a step under `torch.cuda.set_sync_debug_mode("error")`)."""

import pytest
import torch

from flowrl.plan import plan
from flowrl.trainers import load_config


def test_a_host_read_of_a_meta_tensor_raises():
    with pytest.raises((RuntimeError, NotImplementedError)):
        bool(torch.zeros(2, device="meta").any())


@pytest.mark.parametrize(
    "config, overrides",
    [
        ("configs/sd35m/tiny.yaml", []),  # GRPO-Guard: CFG, behaviour means, 1/|dt| step weights
        ("configs/sd35m/tiny.yaml", ["sampling.uncond_grad=false", "sampling.forward_batch_size=16"]),
        ("configs/sd35m/tiny.yaml", ["kl.beta=0.01", "batch.backward=whole"]),  # the reference's pass too
        ("configs/flux/tiny.yaml", []),  # packed latents, the guidance embedding
        ("configs/sd15/tiny.yaml", []),  # DDIM on a UNet
        ("configs/z_image/tiny.yaml", ["model.options.cfg_truncation=0.5"]),  # CFG truncated by timestep
        ("configs/ltx2/tiny.yaml", []),  # audio latents on the ODE inside every step (a host mask's index lists)
        # TempFlow's branches are rollouts of their own joined into one: their shared negative prompt's encoding is
        # one cached tensor, compared without a read
        (
            "configs/sd35m/tiny.yaml",
            ["trainer=tempflow_grpo", "seeds_per_prompt=1", "branches=2", "prompts.group_size=6"],
        ),
        ("configs/sd35m/tiny.yaml", ["trainer=awm", "num_draws=2"]),  # its draws stored in CPU memory
    ],
    ids=[
        "guard-cfg",
        "uncond-no-grad-rescored",
        "kl-whole",
        "flux",
        "ddim-unet",
        "z-image-truncated",
        "ltx2-audio",
        "tempflow-branches",
        "awm-draws",
    ],
)
def test_a_rollout_and_an_update_step_never_read_the_device(config, overrides):
    # `flowrl plan` samples a chunk through the run's sampler and runs a micro-batch's forward and backward through
    # its update scheduler, all on meta tensors: it would raise at the first host read of a device tensor
    result = plan(load_config(config, overrides))
    assert {p.name for p in result.phases} >= {"rollout", "update"}
