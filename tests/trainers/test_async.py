"""The asynchronous mode (`run.mode: async`) on a local Ray cluster: staleness 0 is the synchronous run, a killed
worker's batch is sampled again, a killed driver resumes, every worker dead ends the run with one line."""

import json
import os
import signal
import time

import pytest
import torch

from flowrl.config import save_config
from flowrl.run.async_rollouts import AsyncCollector, AsyncError
from flowrl.trainers import build_trainer
from tests import launch
from tests.conftest import DIGITS_BASE, tiny_config


pytestmark = pytest.mark.distributed
ray = pytest.importorskip("ray", reason="the asynchronous mode needs Ray (the `async` extra)")

# one torch thread for the learner and the worker alike: the synchronous run they are compared with uses one too, so
# every kernel reduces in the same order (a sample drawn on 2 threads differs from one drawn on 1 in the last bits,
# and two updates make that 1e-4). The tests' FLOWRL_THREADING=torch makes trainers keep torch's count, so the
# `cluster` fixture sets it to 1 in this process; the workers set their own from `worker_threads`.
ASYNC = ["run.mode=async", "asynchrony.worker_cpus=0", "asynchrony.worker_threads=1", "run.log_with=[]"]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """One local Ray cluster for the module (each run's collector joins it instead of starting its own), and one
    torch thread in this process while it runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ray.init(
        address="local",  # a new cluster, never one a `ray start` elsewhere on the machine left behind
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()
    torch.set_num_threads(threads)


def _rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.algorithm.trained_module().state_dict().items()}


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    """The synchronous tiny Flow-GRPO run every comparison is against: (metrics rows, final weights)."""
    folder = tmp_path_factory.mktemp("sync")
    trainer = build_trainer(
        tiny_config("flow_grpo", folder, overrides=[*DIGITS_BASE, "run.epochs=3", "run.log_with=[]"])
    )
    trainer.train()
    return _rows(folder), _weights(trainer)


def _assert_same_run(rows, weights, synchronous):
    ref_rows, ref_weights = synchronous
    keys = ("reward/mean", "loss", "clipfrac", "eval/reward", "eval/digits_gold")
    for a, b in zip(rows, ref_rows, strict=True):
        for key in (k for k in keys if k in b):
            assert a[key] == b[key], (a["epoch"], key)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0)


def test_drop_resamples_a_batch_that_arrives_too_stale(tmp_path, synchronous):
    """`on_stale: drop` at staleness 0: the worker samples epoch e + 1 with the old weights while epoch e trains;
    that batch arrives one version stale, is dropped and sampled again: still the synchronous run."""
    trainer = build_trainer(
        tiny_config(
            "flow_grpo",
            tmp_path,
            overrides=[*ASYNC, *DIGITS_BASE, "run.epochs=3", "asynchrony.max_staleness=0", "asynchrony.on_stale=drop"],
        )
    )
    trainer.train()
    rows = _rows(tmp_path)
    assert [r["async/staleness"] for r in rows[1:]] == [0.0, 0.0, 0.0]
    assert [r["async/dropped"] for r in rows[1:]] == [0.0, 1.0, 2.0]
    _assert_same_run(rows, _weights(trainer), synchronous)


def test_staleness_zero_is_the_synchronous_run_even_when_a_worker_is_killed(tmp_path, synchronous, monkeypatch):
    """Staleness 0 (`on_stale: wait`, the default) is the synchronous run; SIGKILL the worker right after it is sent
    epoch 1: a new worker samples epoch 1 again with the same seeds, so the run is still the synchronous one (nothing
    lost, nothing trained twice). (One run for both: a run without the kill is the same run with one worker start
    fewer; `test_drop_...` is another staleness-0 run without one.)"""
    dispatch = AsyncCollector._dispatch
    killed = []

    def dispatch_then_kill(self, epoch):
        pids = self.worker_pids()  # before the dispatch: an actor answers in order, after the batch
        dispatch(self, epoch)
        if epoch == 1 and not killed:
            os.kill(pids[self.tasks[epoch].worker], signal.SIGKILL)
            killed.append(epoch)

    monkeypatch.setattr(AsyncCollector, "_dispatch", dispatch_then_kill)
    trainer = build_trainer(
        tiny_config(
            "flow_grpo", tmp_path, overrides=[*ASYNC, *DIGITS_BASE, "run.epochs=3", "asynchrony.max_staleness=0"]
        )
    )
    trainer.train()
    rows = _rows(tmp_path)
    assert [r["async/staleness"] for r in rows[1:]] == [0.0, 0.0, 0.0]
    assert killed and [r["async/restarts"] for r in rows[1:]] == [0.0, 1.0, 1.0]
    assert trainer.collector.workers == []  # closed at the end
    _assert_same_run(rows, _weights(trainer), synchronous)


def test_every_worker_dead_ends_the_run_with_one_line(tmp_path, monkeypatch):
    """`asynchrony.max_restarts: 0`: the first worker killed is not replaced, and the run ends in one line (a worker
    replaced within the limit: `test_staleness_zero_..._killed`)."""
    dispatch = AsyncCollector._dispatch

    def dispatch_then_kill(self, epoch):
        pids = self.worker_pids()
        dispatch(self, epoch)
        os.kill(pids[self.tasks[epoch].worker], signal.SIGKILL)

    monkeypatch.setattr(AsyncCollector, "_dispatch", dispatch_then_kill)
    config = tiny_config("flow_grpo", tmp_path, overrides=[*ASYNC, *DIGITS_BASE, "asynchrony.max_restarts=0"])
    with pytest.raises(AsyncError, match=r"^every rollout worker died \(0 replaced before\)") as err:
        build_trainer(config).train()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("trainer_name", ["ppo", "text"])
def test_control_and_text_sample_ahead_by_one_version(tmp_path, trainer_name):
    trainer = build_trainer(
        tiny_config(trainer_name, tmp_path, overrides=[*ASYNC, "run.epochs=3", "asynchrony.max_staleness=1"])
    )
    summary = trainer.train()
    rows = _rows(tmp_path)[1:]
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]  # epoch 0 waits; later ones were sampled ahead
    assert all(r["async/dropped"] == 0 for r in rows) and summary["epochs"] == 3


def _descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def _listening(processes) -> set[str]:
    """The addresses the processes listen on (TCP)."""
    import psutil

    found = set()
    for process in processes:
        try:
            connections = process.net_connections(kind="tcp")
        except psutil.Error:  # gone meanwhile
            continue
        found |= {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}
    return found


def _alive(processes) -> list:
    import psutil

    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.Error:
            pass
    return alive


def test_a_killed_driver_resumes_with_nothing_lost(tmp_path, synchronous):
    """kill -9 the `flowrl train` process after its first checkpoint, `--resume`: the synchronous run's numbers. Its
    own Ray cluster listened on this machine's loopback interface only, and none of its processes outlives it by
    more than a few seconds (Ray's agents waited a minute for the dead GCS)."""
    config = tiny_config(
        "flow_grpo",
        tmp_path / "run",
        overrides=[*ASYNC, *DIGITS_BASE, "run.epochs=3", "run.save_every=1", "asynchrony.max_staleness=0"],
    )
    save_config(config, tmp_path / "config.yaml")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = ["train", str(tmp_path / "config.yaml")]  # `flowrl train`, forked from the forkserver (tests/launch.py)
    driver = launch.start(argv, env, tmp_path / "driver.log")
    process = driver.processes[0]
    deadline = time.monotonic() + 240
    while not (tmp_path / "run" / "checkpoints" / "epoch_1").is_dir():
        assert process.is_alive(), driver.log.read_text()[-2000:]
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(0.2)
    ray_processes = _descendants(process.pid)  # GCS, raylet, agents, workers, the reaper
    assert len(ray_processes) >= 4, ray_processes
    assert _listening(ray_processes) <= {"127.0.0.1", "::ffff:127.0.0.1"}, _listening(ray_processes)
    driver.kill()  # SIGKILL: no cleanup in the driver; its local Ray cluster goes with it
    deadline = time.monotonic() + 15
    while _alive(ray_processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(ray_processes), [(p.pid, p.name()) for p in _alive(ray_processes)]
    code, output = launch.run([*argv, "--resume"], env, tmp_path / "resume.log", timeout=300)
    assert code == 0, output[-2000:]
    rows = _rows(tmp_path / "run")
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    ref_rows, _ = synchronous
    for a, b in zip(rows, ref_rows, strict=True):
        key = "reward/mean" if "reward/mean" in b else "eval/reward"
        assert a[key] == b[key], (a["epoch"], key)
