"""Sharding the trained model over the processes, on GPUs (NCCL) or CPUs (gloo): FSDP2 or DeepSpeed ZeRO.

`run.shard: fsdp2` (`torch.distributed.fsdp.fully_shard`) shards each block of the model's `*blocks` lists, then the
rest, over every process. Each block's parameters are all-gathered for its forward and backward and freed after; the
backward reduce-scatters the gradients, summed (flowrl's losses are already each process's share of the window's), so
every process keeps its `1/N` of the gradients and of AdamW's moments.

`run.shard: zero2` / `zero3` hand the module and flowrl's optimizer to a DeepSpeed ZeRO engine (stage 2: gradients and
optimizer state partitioned; stage 3: parameters too); `ZeroBackward` keeps flowrl's accumulation windows.

Every backward (FSDP2, ZeRO) and every forward (FSDP2, ZeRO-3) is then a collective: the update keeps the processes'
calls in step (`Trainer.update`), and checkpoints hold the gathered full tensors, so a sharded run's checkpoint loads
on any process count and its weights read like an unsharded run's.
"""

from __future__ import annotations

import contextlib
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


def shard(module: torch.nn.Module, world: int, device: torch.device, bf16: bool = False, offload: bool = False) -> int:
    """Shard `module` in place over the `world` processes of the default group; gradients are summed over the
    processes, not averaged. Returns the number of blocks sharded on their own.

    With `bf16` (`run.mixed_precision: bf16`) the gathered parameters are bf16 (half the all-gather traffic and
    memory) while the shards, the optimizer state and the gradient reduction stay fp32; the forwards also run under
    autocast, in the rollout as in the update, so the old and new log-probs are computed alike (ratio exactly 1).
    With `offload` the shards, their gradients and so the optimizer's state live in CPU memory (`CPUOffloadPolicy`;
    pinned on CUDA) and each unit's parameters are copied to `device` for its compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mp_policy": policy} if policy is not None else {}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    units = shard_blocks(module)
    for unit in units:
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(module, mesh=mesh, **kwargs)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # each process's loss is its share: the sum is the gradient
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return len(units)


def local_value(x) -> torch.Tensor:
    """A DTensor's full value (a collective), or the tensor itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of `module` in full, on the CPU, by name: FSDP2's shards and ZeRO-3's partitions
    gathered one parameter at a time (a collective: every process calls it, in the same order), ZeRO-2's and
    unsharded parameters as they are. What the asynchronous mode publishes to its rollout workers."""
    out = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "full_tensor"):
            out[name] = p.full_tensor().detach().cpu()
        elif hasattr(p, "ds_id"):
            with _zero_param(p):
                out[name] = p.detach().to("cpu", copy=True).reshape(_shape(p))
        else:
            out[name] = p.detach().cpu()
    return out


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


def load_full_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, model: dict, tensors: dict, metadata: dict
) -> None:
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


# ----------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2 / ZeRO-3
# ----------------------------------------------------------------------------------------------

ZERO_STAGES = {"zero2": 2, "zero3": 3}
"""`run.shard` values served by DeepSpeed, and their ZeRO stage."""


def zero_engine(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: int,
    max_grad_norm: float | None,
    offload: bool = False,
):
    """Wrap `module` and flowrl's `optimizer` in a DeepSpeed ZeRO engine (stage 2: gradients and optimizer state
    partitioned; stage 3: the parameters too) over the processes of the default group. DeepSpeed clips at
    `max_grad_norm` and skips a step whose gradient is not finite; flowrl cuts the minibatches and marks the
    accumulation boundary itself (`ZeroBackward`), so DeepSpeed's batch sizes are placeholders."""
    try:
        import deepspeed
    except ImportError:
        raise ImportError(f"run.shard: zero{stage} needs DeepSpeed: pip install 'flowrl-toolkit[deepspeed]'") from None
    import logging

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines would drown the epoch log
    config = {
        "train_micro_batch_size_per_gpu": 1,  # unused: flowrl feeds its own minibatches
        "gradient_accumulation_steps": 1,  # unused: `ZeroBackward` sets the boundary
        "gradient_clipping": float(max_grad_norm or 0.0),  # 0: no clip (the norm is still measured)
        "zero_optimization": {"stage": stage},
        "steps_per_print": 2**31 - 1,
    }
    if offload:  # ZeRO-Offload: the optimizer state (and, stage 3, the parameters) in CPU memory
        pin = torch.cuda.is_available()
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if stage == 3:
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": pin}
        config["zero_force_ds_cpu_optimizer"] = False  # flowrl's own AdamW steps the offloaded partitions
    with _without_shm_all_reduce():
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine


@contextlib.contextmanager
def _without_shm_all_reduce():
    """On CPUs DeepSpeed's communication backend JIT-compiles a C++ shared-memory all-reduce when it starts (a C++
    compiler and ninja needed; 32 s, 55 CPU-seconds, on a 2-core machine's first ZeRO run), used only by its
    inference all-reduce, which ZeRO never calls. Without it the backend is as on a CPU where the op cannot build:
    every collective goes through torch.distributed."""
    import importlib
    from unittest import mock

    backend = importlib.import_module("deepspeed.comm.torch")  # (`deepspeed.comm.torch` the attribute is torch)
    if torch.cuda.is_available() or not hasattr(backend, "build_shm_op"):  # GPUs build no such op
        yield
        return
    with mock.patch.object(backend, "build_shm_op", lambda: None):
        yield


class ZeroBackward:
    """DeepSpeed's backward, one loss late. ZeRO reduces the gradients in every backward and accumulates them over
    a step's backwards only when the last one is marked as the accumulation boundary, but flowrl learns which
    backward was the last only at `step`: so each loss's backward runs when the next loss arrives (not a
    boundary), and the last one's in `step` (the boundary). Losses are multiplied by the process count because
    DeepSpeed averages the processes' gradients and flowrl's losses are each process's share of the sum."""

    def __init__(self, engine, world: int):
        self.engine, self.world = engine, world
        self.pending: torch.Tensor | None = None
        self.backwards = 0  # since the last step

    def __call__(self, loss: torch.Tensor) -> None:
        self._flush(boundary=False)
        self.pending = loss
        self.backwards += 1

    def _flush(self, boundary: bool) -> None:
        if self.pending is None:
            return
        loss, self.pending = self.pending, None
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def step(self) -> float:
        """The optimizer step over every loss since the last one; the gradient norm before clipping (inf or NaN:
        DeepSpeed skipped the step)."""
        if not self.backwards:  # ZeRO's step reads the gradients a boundary backward left
            raise RuntimeError("a ZeRO optimizer step needs at least one backward since the last step")
        self.backwards = 0
        self._flush(boundary=True)  # a backward since the last step means a loss is pending
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)


def _zero_param(p: torch.nn.Parameter, modifier: bool = False):
    """A context in which `p` holds its full value (ZeRO-3 gathers it; ZeRO-2 parameters are whole already);
    `modifier`: what rank 0 writes into it is scattered back into the partitions on exit."""
    import deepspeed

    if not hasattr(p, "ds_id"):
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters([p], modifier_rank=0 if modifier else None)


def _shape(p: torch.nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def zero_full_state(engine) -> tuple[dict, dict, dict]:
    """A ZeRO run's `(model tensors, optimizer tensors, optimizer metadata)` in `full_state`'s layout, gathered one
    parameter at a time (collectives: every process calls it; the others get empty dicts)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_optimizer_state

    main = dist.get_rank() == 0
    module, optimizer = engine.module, engine.optimizer
    model, tensors = {}, {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            with _zero_param(value):
                full = value.detach().to("cpu", copy=True).reshape(_shape(value))
        else:
            full = value.detach().to("cpu", copy=True)
        model[name] = full.contiguous()
    keys = _zero_init_state(optimizer)
    step = _zero_step(optimizer)
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        for key in keys:
            value = safe_get_full_optimizer_state(p, key)
            tensors[f"state/{name}/{key}"] = value.to("cpu").reshape(_shape(p)).contiguous()
        tensors[f"state/{name}/step"] = torch.tensor(step, dtype=torch.float32)
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params" and _jsonable(v)}
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    metadata = {"param_groups": json.dumps([{**hyper, "params": names}])}
    return (model, tensors, metadata) if main else ({}, {}, {})


def zero_load_full_state(engine, model: dict, tensors: dict, metadata: dict) -> None:
    """Load full states (as `zero_full_state` or `full_state` wrote them) into a ZeRO engine's partitions: the
    module's parameters and buffers, the fp32 master weights and the optimizer's moments and step (collectives)."""
    module, optimizer = engine.module, engine.optimizer
    current = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(current) - set(model)), sorted(set(model) - set(current))
    if missing or unexpected:
        raise KeyError(f"model keys missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, value in current.items():
            if isinstance(value, torch.nn.Parameter):
                with _zero_param(value, modifier=True):
                    value.data.copy_(model[name].reshape(value.data.shape))
            else:
                value.copy_(model[name])
    keys = _zero_init_state(optimizer)
    steps = set()
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        _set_full(p, model[name].to(torch.float32))
        for key in keys:
            _set_full(p, tensors[f"state/{name}/{key}"].to(torch.float32), key)
        steps.add(float(tensors[f"state/{name}/step"]))
    if len(steps) > 1:
        raise ValueError(f"the optimizer state holds different step counts {sorted(steps)}")
    if steps:
        step = steps.pop()
        for state in optimizer.optimizer.state.values():
            if "step" in state:
                state["step"].fill_(step)
    groups = json.loads(metadata.get("param_groups", "[]"))
    if groups:
        for group in optimizer.param_groups:
            group.update({k: v for k, v in groups[0].items() if k in group and k != "params"})


def _set_full(p: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
    """Write the full `value` of `p`'s fp32 master weight (`key` None) or optimizer state `key` into this process's
    partition. ZeRO-3: each process copies its own slice (DeepSpeed's full setter reads past the end of a parameter
    smaller than the processes' partitions)."""
    from deepspeed import utils

    if not hasattr(p, "ds_id"):
        if key is None:
            utils.safe_set_full_fp32_param(p, value)
        else:
            utils.safe_set_full_optimizer_state(p, value, key)
        return
    local = utils.safe_get_local_fp32_param(p) if key is None else utils.safe_get_local_optimizer_state(p, key)
    size = local.numel()
    part = value.flatten()[size * torch.distributed.get_rank() :][:size]
    part = torch.nn.functional.pad(part, (0, size - part.numel())).to(local.device)  # the last partitions' padding
    if key is None:
        utils.safe_set_local_fp32_param(p, part)
    else:
        utils.safe_set_local_optimizer_state(p, part, key)


def _zero_init_state(optimizer) -> tuple[str, ...]:
    """Create the AdamW state of ZeRO's flat partitions where it has none yet (zeros, step 0, as torch's first step
    would; ZeRO-2 creates it lazily) and link it to the parameters, so that full states can be read and written
    before the first step; the state's keys."""
    base = optimizer.optimizer
    if not isinstance(base, torch.optim.AdamW):
        raise TypeError(f"ZeRO checkpoints hold AdamW's state, not {type(base).__name__}'s")
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if base.defaults.get("amsgrad") else ())
    # the fp32 partitions AdamW steps (ZeRO-3 hands them to it one sub-group at a time, so ask ZeRO)
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None) or optimizer.single_partition_of_fp32_groups
    for flat in flats:
        state = base.state[flat]
        if not state:
            state["step"] = torch.tensor(0.0)
            for key in keys:
                state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)  # ZeRO-2's link to the new state
    if link is not None:
        link()
    return keys


def _zero_step(optimizer) -> float:
    """The step count of ZeRO's wrapped optimizer (every partition steps together)."""
    for state in optimizer.optimizer.state.values():
        if "step" in state:
            return float(state["step"])
    return 0.0


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True
