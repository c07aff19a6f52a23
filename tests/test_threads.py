"""flowrl.threads: torch's thread count follows the cores other processes leave free."""

import subprocess
import sys
import time

import pytest
import torch

from flowrl import threads as threads_mod
from flowrl.config import ConfigError, from_dict
from flowrl.sections import RunConfig
from flowrl.threads import ThreadGovernor


@pytest.fixture(autouse=True)
def keep_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("FLOWRL_THREADING", raising=False)
    monkeypatch.setitem(threads_mod._governed, "threads", None)
    yield
    torch.set_num_threads(before)


class FakeClock:
    """Stands in for /proc/stat, the wall clock and this process's CPU time."""

    def __init__(self, monkeypatch):
        self.wall = self.busy = self.own = 0.0
        monkeypatch.setattr(threads_mod, "_cpu_busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(ThreadGovernor, "_now", staticmethod(lambda: self.wall))
        monkeypatch.setattr(threads_mod.time, "process_time", lambda: self.own)

    def run(self, seconds, own_cores, other_cores):
        self.wall += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)


def governor_on_two_cores(monkeypatch, **kwargs):
    torch.set_num_threads(2)
    gov = ThreadGovernor(**kwargs)
    gov.cpus = {0, 1}
    gov.active = True
    return gov


def test_threads_follow_the_free_cores(monkeypatch):
    clock = FakeClock(monkeypatch)
    gov = governor_on_two_cores(monkeypatch)
    assert gov.max_threads == 2
    clock.run(3.0, own_cores=2.0, other_cores=0.05)  # alone: a little background noise
    assert gov.adjust() == 2 and torch.get_num_threads() == 2
    clock.run(3.0, own_cores=1.0, other_cores=1.0)  # a CPU-bound process beside it
    assert gov.adjust() == 1 and torch.get_num_threads() == 1
    assert gov.others == pytest.approx(1.0)
    clock.run(3.0, own_cores=1.0, other_cores=0.9)  # still there: stays at one thread
    assert gov.adjust() == 1
    clock.run(3.0, own_cores=1.0, other_cores=0.0)  # it stopped: every core again
    assert gov.adjust() == 2 and torch.get_num_threads() == 2


def test_short_intervals_do_not_change_the_count(monkeypatch):
    clock = FakeClock(monkeypatch)
    gov = governor_on_two_cores(monkeypatch)
    clock.run(0.5, own_cores=1.0, other_cores=1.0)
    assert gov.adjust() == 2  # half a second is too short to judge; the interval keeps growing
    clock.run(1.0, own_cores=1.0, other_cores=1.0)
    assert gov.adjust() == 1


def test_threads_for_rounds_free_cores_within_bounds(monkeypatch):
    gov = governor_on_two_cores(monkeypatch)
    assert [gov.threads_for(o) for o in (0.0, 0.4, 0.6, 1.0, 1.4, 5.0)] == [2, 2, 1, 1, 1, 1]
    gov.cpus = set(range(8))  # more cores than torch's default: never above the default
    assert gov.threads_for(0.0) == 2


def test_a_new_governor_starts_from_the_ceiling_not_a_lowered_count(monkeypatch):
    clock = FakeClock(monkeypatch)
    gov = governor_on_two_cores(monkeypatch)
    clock.run(2.0, own_cores=1.0, other_cores=1.0)
    assert gov.adjust() == 1
    assert ThreadGovernor().max_threads == 2


def test_fixed_and_torch_settings_and_environment_overrides(monkeypatch):
    gov = ThreadGovernor(1)
    assert not gov.active and torch.get_num_threads() == 1 and gov.adjust() == 1
    torch.set_num_threads(2)
    assert not ThreadGovernor("torch").active
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not ThreadGovernor("auto").active
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("FLOWRL_THREADING", "torch")
    assert not ThreadGovernor("auto").active
    with pytest.raises(ValueError, match="positive integer"):
        ThreadGovernor(0)


def test_run_threads_config_values():
    assert from_dict(RunConfig, {"threads": 3}).threads == 3
    assert from_dict(RunConfig, {"threads": "torch"}).threads == "torch"
    with pytest.raises((ConfigError, ValueError), match="threads"):
        from_dict(RunConfig, {"threads": "many"})
    with pytest.raises((ConfigError, ValueError), match="positive integer"):
        from_dict(RunConfig, {"threads": 0})


@pytest.mark.skipif(threads_mod._cpu_busy_seconds({0}) is None, reason="needs Linux /proc/stat")
def test_a_real_busy_process_is_seen(monkeypatch):
    torch.set_num_threads(2)
    gov = ThreadGovernor()
    gov.active = True
    gov._mark = gov._sample()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(2.0)
        gov.adjust()
    finally:
        busy.kill()
        busy.wait()
    assert gov.others > 0.5  # one CPU-bound process is about one core's worth of others' time
