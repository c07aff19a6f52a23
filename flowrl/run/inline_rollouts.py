"""`asynchrony.backend: inline`: the asynchronous mode's staleness, deterministic and in one process.

A pipeline whose rollout workers keep ahead of the learner trains each epoch on a batch sampled with weights
`max_staleness` updates old (as published every `sync_every` updates). `InlineCollector` reproduces exactly that
schedule without Ray: one `RolloutWorker` in the learner's process (its own copy of the model and its own random
state), the publications of the last few versions kept, and epoch `e` sampled with the oldest kept version `v`
with `e - v <= max_staleness`, just before the learner trains on it. The same seeds give the same batches and the
same numbers on every run, which is what a staleness study needs (a Ray run's staleness depends on timing). No
speed-up: sampling and training take turns.
"""

from __future__ import annotations

import random
import time
from contextlib import contextmanager

import numpy as np
import torch

from flowrl.run import wire
from flowrl.run.async_rollouts import PublishClock, RolloutWorker, async_metrics, publication


class _RandomState:
    """Python's, NumPy's and torch's global random states, swapped in and out as one (the worker's own, as a
    worker process would have)."""

    def __init__(self):
        self.saved = None

    @staticmethod
    def _get():
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda

    @staticmethod
    def _set(state) -> None:
        python, numpy, cpu, cuda = state
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    @contextmanager
    def active(self):
        outer = self._get()
        if self.saved is not None:
            self._set(self.saved)
        try:
            yield
        finally:
            self.saved = self._get()
            self._set(outer)


class InlineCollector:
    """The learner's collector with `asynchrony.backend: inline`: `collect(epoch)` as the synchronous one, the
    batch from an in-process rollout worker at the staleness bound (see the module docstring).

    Args:
        trainer (`flowrl.run.driver.Trainer`): the learner (its config's `asynchrony` section; what it publishes:
            `flowrl.run.async_rollouts.publication`; its modality takes back each batch's worker state).
    """

    def __init__(self, trainer):
        self.trainer, self.config, self.cfg = trainer, trainer.config, trainer.config.asynchrony
        self.worker: RolloutWorker | None = None
        self.random = _RandomState()
        self.version = 0  # updates the learner has made (its weights' version)
        self.published: dict[int, bytes] = {}  # version -> publication, the ones a coming epoch may still use
        self.workers: list = []  # (the Ray backend's list; kept for the driver's and the tests' checks)
        self.clock = PublishClock()

    def _publish(self) -> None:
        start = time.time()
        self.published[self.version] = publication(self.trainer)
        self.clock.add(time.time() - start, self.published[self.version])

    def collect(self, epoch: int):
        """Epoch `epoch`'s batch, sampled with the weights `max_staleness` versions old (or the oldest this run has:
        a fresh or resumed run starts from its first version), with `async/*` metrics in `times`."""
        from flowrl.config import to_dict

        start = time.time()
        if self.worker is None:
            with self.random.active():
                self.worker = RolloutWorker(to_dict(self.config), type(self.trainer.algorithm), 0, threads=None)
            self.version = epoch  # a resumed run starts at its checkpoint's epoch
            self._publish()
        within = [v for v in self.published if self.version - v <= self.cfg.max_staleness]
        if not within:  # `drop` with a bound under sync_every - 1: as the Ray backend, sample with fresh weights
            self._publish()
            within = [self.version]
        version = min(within)
        self.published = {v: blob for v, blob in self.published.items() if v >= version}
        with self.random.active():
            if self.worker.version != version:
                self.worker.load(version, self.published[version])
            collected, header = wire.decode(self.worker.collect(epoch))
        self.trainer.modality.load_state_dict(header["modality"])
        collected.times.update(async_metrics(self.version - version, time.time() - start, 0, 0, 0))
        return collected

    def updated(self, epoch: int) -> dict[str, float]:
        """The learner's weights are version `epoch + 1` after epoch `epoch`'s update: kept when due (every
        `sync_every`); returns the epoch's `async/publish_s` and `async/publish_bytes`, as the Ray backend does."""
        self.version = epoch + 1
        if self.version % self.cfg.sync_every == 0 and self.version < self.config.run.epochs:
            self._publish()
        return self.clock.take()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.worker, self.published = None, {}
