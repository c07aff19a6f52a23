"""The asynchronous mode (`run.mode: async`): rollout workers on Ray apart from the learner, bounded staleness.

Each rollout worker (`flowrl.run.rollout_worker`) is a Ray actor that builds the run's own trainer from the config
(its own policy copy, rewards and prompt sets, one process, no run folder) and serves `collect(epoch)`: the epoch's
`Collected` batch exactly as the synchronous collector makes it (prompts and noise seeded by `(run.seed, epoch)`),
its behaviour log-probs included, so the core's ratio is against the policy that really sampled it. The learner
keeps its trainer and swaps its collector for an `AsyncCollector`:

- weights (the trained module's trainable parameters: the LoRA weights of a LoRA run) and the modality's
  state are published to every worker after every `sync_every` updates, as one safetensors blob;
- worker `i` samples epoch `e` with the newest weights it has; a batch's staleness is the number of updates the
  learner made since those weights. `on_stale: wait` never lets the workers sample more than `max_staleness`
  versions ahead (the learner waits instead); `on_stale: drop` lets them run ahead and drops (and re-samples) a
  batch that arrives staler than `max_staleness`;
- a worker that dies is replaced (at most `max_restarts` times in the run) and its unfinished batch re-sampled;
  when none is left the run ends with one line; the learner's checkpoints are the synchronous run's, so a
  killed driver resumes with `--resume` and re-samples whatever was in flight.

What the workers receive is everything the sampler reads: the trained weights, the lagged copies an algorithm
samples with (DiffusionNFT's old policy, DGPO's after `old_sampling_after`; `Algorithm.sampling_copies`), the
learner's optimizer-step count and the modality's state.

`max_staleness: 0` with `sync_every: 1` waits for a batch of the learner's current weights every epoch: the
synchronous run's numbers, bit for bit when the workers use as many torch threads as the learner.

Under `torchrun` (DDP, FSDP2, ZeRO) the learner is a group: every learner trains its share of each epoch's batch as
in the synchronous mode, its main process alone runs the schedule and talks to Ray, and publishing gathers the full
trained state from the shards (`flowrl.run.learner_group`). Weights travel through Ray's object store; each
epoch's `async/publish_s` and `async/publish_bytes` say what publishing cost the learner.

`backend: inline` (`InlineCollector`) runs one worker in the learner's process, one batch at a time, each sampled
with the stalest weights the bound allows: a deterministic staleness for studies, without Ray.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

from flowrl.run import wire
from flowrl.run.learner_group import broadcast_batch, cluster_gpus, share, visible_gpus
from flowrl.run.rollout_worker import RayRolloutWorker, publication
from flowrl.run.rollout_worker import RolloutWorker as RolloutWorker  # re-exported: the inline mode's worker
from flowrl.run.rollout_worker import trainable_state as trainable_state  # re-exported


class AsyncError(RuntimeError):
    """The asynchronous mode cannot go on (every rollout worker died, Ray is missing or unreachable)."""


def async_metrics(staleness: int, wait_s: float, dropped: int, restarts: int, worker: int) -> dict[str, float]:
    """The `async/*` metrics of an epoch's batch: its staleness (versions), the learner's wait for it, the run's
    dropped batches and replaced workers so far, and the worker that sampled it."""
    return {
        "async/staleness": float(staleness),
        "async/wait_s": wait_s,
        "async/dropped": float(dropped),
        "async/restarts": float(restarts),
        "async/worker": float(worker),
    }


class PublishClock:
    """The seconds and bytes of an epoch's publications (`async/publish_s`, `async/publish_bytes`)."""

    def __init__(self):
        self.seconds, self.bytes = 0.0, 0

    def add(self, seconds: float, blob: bytes | None) -> None:
        self.seconds += seconds
        self.bytes += len(blob or b"")

    def take(self) -> dict[str, float]:
        """The totals since the last call, reset."""
        out = {"async/publish_s": self.seconds, "async/publish_bytes": float(self.bytes)}
        self.seconds, self.bytes = 0.0, 0
        return out


@dataclasses.dataclass
class _Task:
    epoch: int
    worker: int
    version: int
    ref: object


class AsyncCollector:
    """The learner's collector in the asynchronous mode: `collect(epoch)` as the synchronous one, the batch from
    the rollout workers (see the module docstring). In a learner group (`torchrun`) every learner has one: the main
    process runs the schedule and talks to Ray, the others take their share of each batch from it and join the
    publications (`flowrl.run.learner_group`).

    Args:
        trainer (`flowrl.run.driver.Trainer`): the learner (its config's `asynchrony` section and `run.epochs`; what
            it publishes: `publication`; its modality takes back each batch's worker state).
    """

    def __init__(self, trainer):
        self.trainer, self.config, self.cfg = trainer, trainer.config, trainer.config.asynchrony
        self.modality = trainer.modality
        self.processes = trainer.engine.processes
        self.main = self.processes.is_main
        self.version = 0  # updates the learner has made (its weights' version)
        self.published = -1  # the version the workers have
        self.started = False
        self.workers: list = []
        self.tasks: dict[int, _Task] = {}
        self.restarts = self.dropped = 0
        self.started_ray = False
        self.weights_ref = None
        self.latest: bytes | None = None  # a learner group's current publication, kept for a re-publish (`drop`)
        self.clock = PublishClock()
        self.gpus: list[str] = []  # what a run's own Ray cluster may give its workers
        if self.main and self.cfg.address is None:
            learners = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if trainer.engine.device.type == "cuda" else 0
            try:
                self.gpus = cluster_gpus(visible_gpus(), learners, self.cfg.worker_gpus, self.cfg.share_gpus)
            except ValueError as err:
                raise AsyncError(str(err)) from None

    # ------------------------------------------------------------------------------------------
    # workers
    # ------------------------------------------------------------------------------------------

    def _ray(self):
        try:
            import ray
        except ImportError:
            raise AsyncError("run.mode=async needs Ray: pip install 'flowrl-toolkit[async]'") from None
        if not ray.is_initialized():
            # a run's own cluster sees only the GPUs no learner uses: its processes inherit this variable
            local = {"num_gpus": len(self.gpus)} if self.cfg.address is None else {}
            saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            sigterm = signal.getsignal(signal.SIGTERM)
            if self.cfg.address is None:
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
            from flowrl.run.local_ray import start_local_cluster

            # a cluster of its own: on this machine's loopback interface, its processes gone with the run
            start = ray.init if self.cfg.address is not None else lambda **kw: start_local_cluster(ray, **kw)
            try:
                start(
                    address=self.cfg.address,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                    runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}},
                    **local,
                )
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise AsyncError(f"cannot reach the Ray cluster at {self.cfg.address!r}: {err}") from None
            finally:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
                if sigterm is not None and threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, sigterm)  # Ray's own would exit (or abort) without a word
            self.started_ray = True
        return ray

    def _spawn(self, index: int):
        from flowrl.config import to_dict

        ray = self._ray()
        actor = ray.remote(
            num_cpus=self.cfg.worker_cpus,
            num_gpus=self.cfg.worker_gpus,
            max_restarts=0,
            scheduling_strategy="SPREAD",  # one worker per node first: a lost node takes few with it
        )(RayRolloutWorker)
        worker = actor.remote(
            to_dict(self.config),
            type(self.trainer.algorithm),
            index,
            self.cfg.worker_threads,
            self.cfg.worker_gpus == 0,
        )
        if self.weights_ref is not None:
            worker.load.remote(self.published, self.weights_ref)
        return worker

    def _publish(self, blob: bytes | None = None) -> None:
        """The weights of version `self.version` to every worker, through Ray's object store (`blob`: a publication
        made already). Without `blob`, every learner of a sharded group must call it (the weights are gathered)."""
        start = time.time()
        blob = publication(self.trainer) if blob is None else blob
        if self.main:
            self.weights_ref = self._ray().put(blob)
            for worker in self.workers:
                if worker is not None:
                    worker.load.remote(self.version, self.weights_ref)
        self.published = self.version
        self.clock.add(time.time() - start, blob)

    def _replace(self, index: int, err: Exception) -> None:
        """Worker `index` died (or its batch was lost with its node): a new one takes its place (with the newest
        weights), its batches are re-sampled."""
        try:  # a batch lost with its node's object store: its worker went with the node (or is stopped now)
            self._ray().kill(self.workers[index])
        except Exception:  # noqa: BLE001 - dead already
            pass
        if self.restarts >= self.cfg.max_restarts:
            self.workers[index] = None
            if all(w is None for w in self.workers):
                raise AsyncError(
                    f"every rollout worker died ({self.restarts} replaced before); the last: "
                    f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                )
        else:
            self.restarts += 1
            self.workers[index] = self._spawn(index)
        for task in [t for t in self.tasks.values() if t.worker == index]:
            del self.tasks[task.epoch]

    # ------------------------------------------------------------------------------------------
    # the schedule
    # ------------------------------------------------------------------------------------------

    def _may_sample(self, epoch: int) -> bool:
        return self.cfg.on_stale == "drop" or epoch - self.published <= self.cfg.max_staleness

    def _dispatch(self, epoch: int) -> None:
        busy = {t.worker for t in self.tasks.values()}
        live = [i for i, w in enumerate(self.workers) if w is not None]
        free = [i for i in live if i not in busy] or live
        index = min(free, key=lambda i: sum(t.worker == i for t in self.tasks.values()))
        ref = self.workers[index].collect.remote(epoch)
        self.tasks[epoch] = _Task(epoch, index, self.published, ref)

    def _fill(self, first: int) -> None:
        """Dispatch epochs from `first` on while a worker is free and the staleness bound allows."""
        live = [i for i, w in enumerate(self.workers) if w is not None]
        epoch = first
        while epoch < self.config.run.epochs and len(self.tasks) < len(live):
            if epoch not in self.tasks:
                if not self._may_sample(epoch):
                    break
                self._dispatch(epoch)
            epoch += 1

    def _receive(self, epoch: int):
        """(The main process.) Epoch `epoch`'s batch from the workers, waiting for it when needed: `(collected,
        header, blob, metrics)`, the metrics `async_metrics`' arguments."""
        from ray.exceptions import ObjectLostError, RayActorError, WorkerCrashedError

        ray = self._ray()
        start = time.time()
        for task in [t for t in self.tasks.values() if t.epoch < epoch]:  # a resumed or restored schedule
            del self.tasks[task.epoch]
        while True:
            self._fill(epoch)
            if epoch not in self.tasks:
                self._dispatch(epoch)
            task = self.tasks[epoch]
            try:
                blob = ray.get(task.ref)
            except (RayActorError, WorkerCrashedError, ObjectLostError) as err:  # a worker or its node lost
                self._replace(task.worker, err)
                continue
            del self.tasks[epoch]
            collected, header = wire.decode(blob)
            staleness = self.version - header["version"]
            if staleness > self.cfg.max_staleness:
                self.dropped += 1
                if self.version - self.published > self.cfg.max_staleness:
                    self._publish(self.latest)  # the re-sampled batch must meet the bound
                continue  # re-sampled with the newest weights
            break
        waited = time.time() - start
        self._fill(epoch + 1)  # the next epochs sample while this one trains
        return collected, header, blob, [staleness, waited, self.dropped, self.restarts, header["worker"]]

    def collect(self, epoch: int):
        """Epoch `epoch`'s batch from the workers (waiting for it when needed), this learner's share of it, with
        `async/*` metrics in `times`."""
        if not self.started:  # a fresh or resumed run: the workers start with the learner's current weights
            self.started = True
            self.version = epoch  # a resumed run starts at its checkpoint's epoch
            if self.main:
                self.workers = [self._spawn(i) for i in range(self.cfg.rollout_workers)]
            self._publish()
        collected = header = blob = None
        metrics = [0.0] * 5  # `async_metrics`' arguments: the main learner's reach the others with the batch
        if self.main:
            collected, header, blob, metrics = self._receive(epoch)
        if self.processes.world > 1:  # the main learner's batch to every learner, each keeping its share
            blob, metrics = broadcast_batch(blob, metrics, self.processes)
            if not self.main:
                collected, header = wire.decode(blob)
            collected = share(collected, self.processes)
        self.modality.load_state_dict(header["modality"])
        collected.times.update(async_metrics(*metrics))
        return collected

    def updated(self, epoch: int) -> dict[str, float]:
        """The learner finished epoch `epoch`'s update: its weights are version `epoch + 1`; publish when due.
        Returns the epoch's `async/publish_s` and `async/publish_bytes`."""
        self.version = epoch + 1
        self.latest = None
        if self.version < self.config.run.epochs:
            if self.version % self.cfg.sync_every == 0:
                self._publish()
            elif self.processes.world > 1 and self.cfg.max_staleness < self.cfg.sync_every - 1:
                start = time.time()  # `drop` may re-publish these weights mid-collect, on the main learner alone
                self.latest = publication(self.trainer)
                self.clock.add(time.time() - start, None)
        return self.clock.take()

    def close(self) -> None:
        """Stop the workers (and the local Ray cluster this run started)."""
        self.started = False
        if not self.workers and not self.started_ray:
            return
        import ray

        live = [worker for worker in self.workers if worker is not None]
        try:  # each live worker removes its scratch run folder; a hung one is killed anyway
            ray.get([worker.close.remote() for worker in live], timeout=10)
        except Exception:  # noqa: BLE001 - a worker that died meanwhile has nothing left to close
            pass
        for worker in live:
            ray.kill(worker)
        self.workers, self.tasks = [], {}
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    def worker_pids(self) -> list[int | None]:
        """The workers' process ids (None: dead for good), for tests and monitoring."""
        ray = self._ray()
        return [None if w is None else ray.get(w.pid.remote()) for w in self.workers]

    def worker_nodes(self) -> list[str | None]:
        """The Ray node of each worker (None: dead for good), for tests and monitoring."""
        ray = self._ray()
        return [None if w is None else ray.get(w.node.remote()) for w in self.workers]
