"""No host syncs in the denoising loops: a rollout and an update step run on `meta` tensors, which hold no data, so
any read of a device value on the host (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`) raises. The schedule is host
data and the step kernels mask zero-std rows instead of reading them (`flowrl.policies.sde`); on a GPU each such read
would wait for the device (tests/test_gpu.py runs a step under `torch.cuda.set_sync_debug_mode("error")`).

The other way waits too: a blocking copy of host memory to the GPU (`.to(device)` of a CPU tensor without
`non_blocking`, or indexing a GPU tensor with CPU indices, which copies them so) waits for every queued kernel. On
meta tensors such a copy is a CPU tensor meeting a meta one; `BlockingCopies` records each inside the rollout and the
update step."""

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flowrl.plan import plan
from flowrl.trainers import load_config


ONCE_PER_ROLLOUT = {"encode", "encode_prompt", "initial_latents", "static_inputs"}
"""Host data copied once per rollout, not per step: token ids (prompts are encoded once and cached), the first noise
and a family's position ids."""


class BlockingCopies(TorchDispatchMode):
    """Records where the rollout (`trace_rollout`) and the update (`trace_update`) copy a CPU tensor to the device
    with a blocking copy: `_to_copy`/`copy_` from the CPU without `non_blocking`, or any other op given a CPU tensor
    of one or more dimensions beside device tensors (0-dim CPU tensors are passed as numbers)."""

    def __init__(self):
        super().__init__()
        self.sites: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_"):
            source, target = (args[1], args[0].device) if name == "copy_" else (args[0], kwargs.get("device"))
            blocking = not (args[2] if name == "copy_" and len(args) > 2 else kwargs.get("non_blocking", False))
            found = blocking and source.device.type == "cpu" and target is not None
            found = found and torch.device(target).type == "meta"
        else:
            found = any(t.device.type == "meta" for t in tensors) and any(
                t.device.type == "cpu" and t.dim() > 0 for t in tensors
            )
        if found:
            stack = traceback.extract_stack()
            names = {frame.name for frame in stack}
            callers = [f for f in stack if "/torch/" not in f.filename and "/flowrl/plan/" not in f.filename]
            library = "/diffusers/" in callers[-2].filename  # its own code (a rotary table cached on first call)
            if names & {"trace_rollout", "trace_update"} and not names & ONCE_PER_ROLLOUT and not library:
                ours = [f for f in callers[:-1] if "/diffusers/" not in f.filename]  # [-1]: this method
                self.sites.add(f"{ours[-1].filename.split('/')[-1]}:{ours[-1].lineno} ({name})")
        return func(*args, **kwargs)


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
    with BlockingCopies() as copies:
        result = plan(load_config(config, overrides))
    assert {p.name for p in result.phases} >= {"rollout", "update"}
    assert not copies.sites, f"blocking host-to-device copies: {sorted(copies.sites)}"


def test_blocking_copies_finds_a_blocking_copy_and_passes_a_non_blocking_one():
    def trace_update():  # the name the recorder looks for on the stack
        host, device = torch.arange(4), torch.zeros(4, device="meta")
        _ = device[host.to(device.device, non_blocking=True)]  # queued behind the kernels: not recorded
        _ = device + host.to("meta")  # blocking: recorded
        _ = device[host]  # CPU indices into a device tensor: recorded

    with BlockingCopies() as copies:
        trace_update()
    assert len(copies.sites) == 2, copies.sites
