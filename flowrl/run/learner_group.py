"""The asynchronous mode's learner group and placement: a `torchrun` group of learners behind Ray rollout workers.

With `run.mode: async` under `torchrun` (DDP, FSDP2, ZeRO-2/3) the learner processes train as the synchronous mode
does, each on its contiguous share of the epoch's batch (the batch contract), while the rollout workers sample.
Rank 0 alone talks to Ray: it receives each epoch's batch from a worker and sends it to the other learners over
the process group (`broadcast_batch`: the wire blob as bytes, never a pickle); every learner keeps its share
(`share`). Publishing is a collective: each learner takes part in gathering the full trained state from the
shards (`flowrl.run.sharding.full_parameters`), and rank 0 puts it in Ray's object store.

Placement: a run's own Ray cluster (`asynchrony.address: null`) gets only the GPUs of this machine that its
learner processes do not use (`cluster_gpus`), so a rollout worker never lands on a learner's GPU unless
`asynchrony.share_gpus` asks for it; on a cluster you started, the nodes' `ray start --num-gpus` decide.
"""

from __future__ import annotations

import dataclasses
import os

import torch


LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""What `torchrun` tells its processes about their group: a rollout worker started by a learner's Ray cluster
inherits them and must not read them (it would wait for a group it is no member of)."""


def leave_learner_group(environ=None) -> None:
    """Remove `torchrun`'s group variables from `environ` (a rollout worker's process, which Ray started from a
    learner's environment)."""
    env = os.environ if environ is None else environ
    for key in [k for k in env if k in LAUNCHER_VARIABLES or k.startswith("TORCHELASTIC_")]:
        del env[key]


def share(collected, processes):
    """This learner's contiguous share of a whole epoch's `Collected` batch (a rollout worker samples all of it),
    as the synchronous collector of this process would hold it: `data` and `rows` cut, the gathered prompts,
    rewards and statistics kept whole."""
    if processes.world == 1:
        return collected
    local = processes.local_slice(len(collected.data))
    return dataclasses.replace(collected, data=collected.data.select(local), rows=collected.rows[local])


def broadcast_batch(blob: bytes | None, numbers: list[float], processes) -> tuple[bytes, list[float]]:
    """Rank 0's `blob` (a batch as `flowrl.run.wire` bytes) and `numbers` (its `async/*` metrics; the others
    pass as many placeholders) on every learner: two broadcasts over the process group (gloo on CPUs, NCCL on
    GPUs), the bytes as a uint8 tensor."""
    import torch.distributed as dist

    device, main = processes.device, processes.is_main
    head = torch.zeros(1 + len(numbers), dtype=torch.float64, device=device)
    if main:
        head[0] = len(blob)
        head[1:] = torch.tensor(numbers, dtype=torch.float64)
    dist.broadcast(head, src=0)
    if main:
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
    else:
        data = torch.empty(int(head[0]), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return (blob if main else data.cpu().numpy().tobytes()), head[1:].cpu().tolist()


def visible_gpus(environ=None) -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` names them (all of them when it is unset)."""
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def cluster_gpus(visible: list[str], learner_gpus: int, worker_gpus: float, share_gpus: bool) -> list[str]:
    """The GPUs a run's own Ray cluster may give its rollout workers: this machine's `visible` GPUs but the first
    `learner_gpus` (the learner processes', one per local rank, as accelerate places them), or all of them with
    `share_gpus`. Workers that ask for GPUs (`worker_gpus > 0`) when none is left are refused with one line."""
    free = list(visible) if share_gpus else list(visible[learner_gpus:])
    if worker_gpus > 0 and not free:
        if not visible:
            raise ValueError(
                f"asynchrony.worker_gpus is {worker_gpus:g} but this machine has no GPU: set "
                "asynchrony.worker_gpus: 0 (workers on CPUs)"
            )
        raise ValueError(
            f"asynchrony.worker_gpus is {worker_gpus:g} but the {learner_gpus} learner process(es) "
            f"use all {len(visible)} GPU(s) of this machine: set asynchrony.share_gpus: true to let "
            "workers share them (worker_gpus a fraction), launch fewer learner processes, or start a "
            "Ray cluster with GPUs of its own (asynchrony.address)"
        )
    return free
