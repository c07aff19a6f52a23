"""A rollout worker of the asynchronous mode and what it receives (`flowrl.run.async_rollouts`).

A `RolloutWorker` builds the run's own trainer from the config (its own policy copy, rewards and prompt sets, one
process, no run folder) and serves `collect(epoch)`: the epoch's `Collected` batch exactly as the synchronous
collector makes it, as a blob (`flowrl.run.wire`). `publication` is what the learner sends it, as one blob: the
trained weights (`trainable_state`: a LoRA run's adapters), the lagged copies an algorithm samples with, the
optimizer-step count and the modality's state; `RolloutWorker.load` takes it. `RayRolloutWorker` is the same worker
in a Ray actor's process (`AsyncCollector`); `InlineCollector` (`flowrl.run.inline_rollouts`) runs one in the
learner's process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from flowrl.run import sharding, wire
from flowrl.run.learner_group import leave_learner_group
from flowrl.run.registry import load_config


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the rollout workers need of the trained module: its trainable parameters (a LoRA run's adapters).
    Buffers are left out: the workers build the same ones from the config, and a large model's positional tables
    would travel every sync for nothing."""
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def publication(trainer) -> bytes | None:
    """Everything a rollout worker's sampler reads of the learner, as one blob: the trained weights, the lagged
    copies the algorithm samples with, the optimizer-step count (DGPO switches to its copy after a number of
    steps) and the modality's state. In a learner group the main process gets the blob and the others None; a
    sharded group's learners must all call it (the full weights are gathered from the shards)."""
    engine, algorithm = trainer.engine, trainer.algorithm
    if not (engine.is_main or engine.sharded):
        return None
    weights = sharding.full_parameters(algorithm.trained_module())
    lagged = {
        k: sharding.local_value(v).detach().cpu()
        for copy in algorithm.sampling_copies()
        for k, v in copy.state_dict().items()
    }
    if not engine.is_main:
        return None
    return wire.encode(
        {
            "weights": weights,
            "lagged": lagged,
            "modality": trainer.modality.state_dict(),
            "optimizer_steps": trainer.engine.optimizer_steps,
        }
    )


class RolloutWorker:
    """One rollout worker (run as a Ray actor by `AsyncCollector`; usable in-process for tests).

    Args:
        config (`dict`): the run's resolved config (`flowrl.config.to_dict`).
        algorithm (`type`): the learner's `Algorithm` class (Ray sends it by name, so a worker's process imports
            its module, and with it `flowrl.trainers`, whose package registers every trainer, before it builds the
            trainer; a config class alone does not: the text trainer's `TextConfig` lives in `flowrl.llm`).
        index (`int`): the worker's number (its run folder's name, its log lines).
        threads (`int` or `None`): torch threads (None: leave the process's count, as an inline worker does).
        cpu (`bool`): sample on the CPU even when a GPU is visible (a Ray worker that reserved none).
    """

    def __init__(self, config: dict, algorithm: type, index: int, threads: int | None = 1, cpu: bool = False):
        from flowrl.run.driver import Trainer

        if threads is not None:
            torch.set_num_threads(max(1, threads))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.index = index
        self.folder = scratch_folder(index)
        # one process: nothing to shard or offload (the learner group's `run.shard` is the learners')
        overrides = [
            f"run.output_dir={self.folder}",
            "run.log_with=[]",
            "run.mode=sync",
            "run.shard=none",
            "run.offload=false",
            f"run.threads={'torch' if threads is None else threads}",
            *(["run.cpu=true"] if cpu else []),
        ]
        self.trainer = Trainer(load_config(config, overrides, algorithm.config_class))
        self.module = self.trainer.algorithm.trained_module()
        self.version = -1

    def pid(self) -> int:
        return os.getpid()

    def load(self, version: int, blob: bytes) -> int:
        """Take the learner's weights (and modality state) of `version`."""
        value, _ = wire.decode(blob)
        weights = value["weights"]
        missing = set(weights) - set(trainable_state(self.module))
        if missing:
            raise wire.WireError(
                f"rollout worker {self.index}: the learner sent weights it has no place for: {sorted(missing)[:3]}"
            )
        with torch.no_grad():
            self.module.load_state_dict(weights, strict=False)
        for copy in self.trainer.algorithm.sampling_copies():
            copy.load_state_dict(value["lagged"])
        self.trainer.engine.optimizer_steps = value["optimizer_steps"]
        self.trainer.modality.load_state_dict(value["modality"])
        self.version = version
        return version

    def close(self) -> None:
        """Remove the worker's scratch run folder."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def collect(self, epoch: int) -> bytes:
        """Epoch `epoch`'s batch, sampled and scored with the newest weights, as a blob (`wire.encode`)."""
        trainer = self.trainer
        trainer.algorithm.epoch = epoch
        trainer.engine.model.eval()
        collected = trainer.collector.collect(epoch)
        return wire.encode(
            collected, epoch=epoch, version=self.version, worker=self.index, modality=trainer.modality.state_dict()
        )


SCRATCH = "flowrl-rollout-"
"""The prefix of a rollout worker's scratch run folder in the temporary folder: `flowrl-rollout-INDEX-PID-XXXXXXXX`."""


def scratch_folder(index: int) -> Path:
    """A new scratch run folder for worker `index`, named with this process's id. The folders of workers whose
    process has ended are removed first: a worker killed (a lost node, SIGKILL) never ran `close`."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH}*"):
        parts = folder.name[len(SCRATCH) :].split("-")  # INDEX, PID, mkdtemp's letters (never a hyphen)
        if len(parts) == 3 and parts[1].isdigit() and not _running(int(parts[1])):
            shutil.rmtree(folder, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH}{index}-{os.getpid()}-"))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True


class RayRolloutWorker(RolloutWorker):
    """A rollout worker in a Ray actor's process: out of the learner group whose launcher variables Ray's processes
    inherit, on the CPU unless Ray gave it a GPU (`asynchrony.worker_gpus`)."""

    def __init__(self, config: dict, algorithm: type, index: int, threads: int, cpu: bool):
        leave_learner_group()
        super().__init__(config, algorithm, index, threads, cpu=cpu)

    def node(self) -> str:
        """The Ray node this worker runs on (its id)."""
        import ray

        return ray.get_runtime_context().get_node_id()
