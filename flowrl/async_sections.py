"""The `asynchrony` config section: the rollout workers, weight publishing and staleness bound of `run.mode:
async` (docs/async.md). Every config has it (`flowrl.sections.BaseConfig`, which re-exports it); the run's
asynchronous mode (`flowrl.run.async_rollouts`, `flowrl.run.inline_rollouts`) reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from flowrl.config import run_checks


@dataclasses.dataclass
class AsynchronyConfig:
    """`run.mode: async`: rollout workers on Ray apart from the learner (docs/async.md)."""

    rollout_workers: int = 1
    """Ray actors that sample rollouts and score their rewards, each with its own copy of the policy."""
    sync_every: int = 1
    """Publish the learner's weights (LoRA-only in a LoRA run) to the workers every this many updates (epochs)."""
    max_staleness: int = 1
    """How many policy versions (updates) a batch may lag the learner's weights: 0 (with `sync_every: 1`) waits for
    a batch of the current weights every epoch, which is the synchronous run; k lets the workers sample up to k
    epochs ahead while the learner trains."""
    on_stale: Literal["wait", "drop"] = "wait"
    """`wait`: a worker never samples more than `max_staleness` versions ahead (the learner waits instead);
    `drop`: workers sample ahead freely and a batch staler than `max_staleness` on arrival is dropped (counted in
    `async/dropped`) and sampled again with the newest weights."""
    backend: Literal["ray", "inline"] = "ray"
    """`ray`: the rollout workers are Ray actors that sample while the learner trains. `inline`: one rollout worker
    in the learner's process samples each epoch just before the update, with the weights of exactly the stalest
    version the bound allows (`max_staleness` updates old, as published every `sync_every`): what a pipeline whose
    workers keep ahead trains on, deterministic and without Ray, for staleness studies and tests (no speed-up; a
    second copy of the model in memory)."""
    address: str | None = None
    """The Ray cluster: None starts a local one for the run; `auto` joins the cluster `ray start --head` started
    on this machine; `HOST:PORT` another machine's."""
    worker_threads: int = 1
    """torch threads of each rollout worker."""
    worker_cpus: float = 1.0
    """CPUs Ray reserves for each worker (0: none, e.g. to oversubscribe a small machine)."""
    worker_gpus: float = 0.0
    """GPUs Ray reserves for each worker (a fraction shares one); 0: the workers sample on CPUs."""
    share_gpus: bool = False
    """Let the rollout workers use the GPUs of this machine's learner processes. Without it the Ray cluster a run
    starts (`address: null`) holds only the GPUs no learner uses, so a worker never shares a learner's GPU; with
    it, one GPU can hold the learner and a worker (`worker_gpus` a fraction). A cluster you start places workers
    by its nodes' `ray start --num-gpus`."""
    max_restarts: int = 3
    """Dead workers replaced in the run (each one's unfinished batch sampled again) before it ends with one line."""

    def __post_init__(self):
        run_checks(
            [
                (self.rollout_workers >= 1, "asynchrony.rollout_workers must be >= 1"),
                (self.sync_every >= 1, "asynchrony.sync_every must be >= 1"),
                (self.max_staleness >= 0, "asynchrony.max_staleness must be >= 0"),
                (
                    self.on_stale == "drop" or self.max_staleness >= self.sync_every - 1,
                    "asynchrony.max_staleness must be >= sync_every - 1 with on_stale: wait (weights published every "
                    "sync_every updates are up to sync_every - 1 versions old)",
                ),
                (self.max_restarts >= 0, "asynchrony.max_restarts must be >= 0"),
                (self.worker_threads >= 1, "asynchrony.worker_threads must be >= 1"),
                (
                    self.worker_cpus >= 0 and self.worker_gpus >= 0,
                    "asynchrony.worker_cpus and worker_gpus must be >= 0",
                ),
            ]
        )
