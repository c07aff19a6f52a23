"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the trained model: parameters, gradients and optimizer state
split over the processes, on GPUs (NCCL) or CPUs (gloo).

`run.shard: fsdp2` shards each block of the model's `*blocks` lists, then the rest, over every process. Each block's
parameters are all-gathered for its forward and backward and freed after; the backward reduce-scatters the
gradients, summed (flowrl's losses are already each process's share of the window's), so every process keeps
its `1/N` of the gradients and of AdamW's moments. Every forward and backward is then a collective: the update
keeps the processes' calls in step (`Trainer.update`), and checkpoints hold the gathered full tensors, so a
sharded run's checkpoint loads on any process count and its weights read like an unsharded run's.
"""

from __future__ import annotations

import json

import torch


MODEL_FILE = "sharded_model.safetensors"
"""The full (gathered) model state of a sharded run, beside `accelerate/` in a checkpoint."""
OPTIMIZER_FILE = "sharded_optimizer.safetensors"
"""The full optimizer state of a sharded run: `state/<parameter>/<key>` tensors, the param groups as metadata."""


def shard_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The units sharded on their own: the entries of every `ModuleList` whose name ends in `blocks`
    (`transformer_blocks`, `single_transformer_blocks`, `down_blocks`, ...), outermost lists only."""
    units, lists = [], []
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and name.split(".")[-1].endswith("blocks"):
            if not any(name.startswith(f"{outer}.") for outer in lists):
                lists.append(name)
                units.extend(child)
    return units


def shard(module: torch.nn.Module, world: int, device: torch.device) -> int:
    """Shard `module` in place over the `world` processes of the default group; gradients are summed over the
    processes, not averaged. Returns the number of blocks sharded on their own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    units = shard_blocks(module)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # each process's loss is its share: the sum is the gradient
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return len(units)


def local_value(x) -> torch.Tensor:
    """A DTensor's full value (a collective), or the tensor itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    """`(model tensors, optimizer tensors, optimizer metadata)`, gathered in full to the main process's CPU (a
    collective: every process calls it; the others get empty dicts), ready for `safetensors`."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = {k: v.contiguous() for k, v in get_model_state_dict(module, options=options).items()}
    optim = get_optimizer_state_dict(module, optimizer, options=options)
    if "state" not in optim:  # not the main process: torch keeps the offloaded full state on rank 0 only
        return model, {}, {}
    tensors = {}
    for name, entries in optim["state"].items():
        for key, value in entries.items():
            tensors[f"state/{name}/{key}"] = torch.as_tensor(value).contiguous()
    metadata = {"param_groups": json.dumps(optim["param_groups"])}
    return model, tensors, metadata


def load_full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, model: dict, tensors: dict,
                    metadata: dict) -> None:  # fmt: skip
    """Scatter full states (as `full_state` wrote them) into the sharded `module` and `optimizer` (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(module, model, options=options)
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        _, name, entry = key.split("/")
        state.setdefault(name, {})[entry] = value
    groups = json.loads(metadata["param_groups"])
    set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": groups}, options=options)
