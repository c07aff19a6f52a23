"""The Ray cluster a run starts for itself is a new one, whatever `RAY_ADDRESS` or an earlier `ray start` says, and
its reaper ends Ray's processes a killed driver leaves, and no others."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

import pytest


def test_the_run_s_own_cluster_is_started_with_address_local(monkeypatch):
    pytest.importorskip("ray", reason="the asynchronous mode needs Ray (the `async` extra)")
    from flowrl.run.local_ray import start_local_cluster

    calls = []
    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(address_info={}))
    # `ray.init()` without an address would join this one (and a dead head's address file is read the same way)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    start_local_cluster(fake, address=None, include_dashboard=False)
    assert calls == [{"address": "local", "include_dashboard": False}]


KILLED_DRIVER = """
import os, signal, subprocess, sys, time
import ray
from flowrl.run.local_ray import start_local_cluster

context = start_local_cluster(ray, num_cpus=1, include_dashboard=False)
logs = os.path.join(context.address_info["session_dir"], "logs")
# not Ray's: a process holding a folder of the cluster's open, as `tail -f` of a log or a removal of the folder does
hold = f"import os, time; fd = os.open({logs!r}, os.O_RDONLY); time.sleep(60)"
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the test reads the driver's output to its end
bystander = subprocess.Popen([sys.executable, "-c", hold], start_new_session=True, **quiet)

@ray.remote
class Actor:
    def pid(self):
        return os.getpid()

actor = ray.get(Actor.remote().pid.remote())
print(bystander.pid, actor, flush=True)
time.sleep(0.5)  # the bystander has opened the folder
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the reaper reads /proc (Linux)")
def test_the_reaper_ends_ray_s_processes_of_a_killed_driver_and_no_other():
    """A driver killed with SIGKILL: its Ray actor ends within seconds; a process that is not Ray's but holds a folder
    of the cluster's session open lives on (the reaper killed it once: pytest removing the test's Ray folder)."""
    pytest.importorskip("ray", reason="the asynchronous mode needs Ray (the `async` extra)")
    folder = tempfile.mkdtemp(prefix="ray-")  # short: the cluster's socket paths must fit in 107 characters
    env = {**os.environ, "RAY_TMPDIR": folder, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", KILLED_DRIVER], env=env, capture_output=True, text=True, timeout=120)
    try:
        assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
        bystander, actor = map(int, done.stdout.split())
        deadline = time.monotonic() + 15
        while _alive(actor) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(actor), "the killed driver's Ray actor outlived it by 15 s"
        time.sleep(2.0)  # the reaper's last sweep is over: it stops once it finds no Ray process
        assert _alive(bystander), "the reaper killed a process that is not Ray's"
    finally:
        for pid in map(int, done.stdout.split()):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


GROUPS_DRIVER = """
import os, psutil, ray
from flowrl.run.local_ray import start_local_cluster

start_local_cluster(ray, num_cpus=1, include_dashboard=False)
ray.get(ray.remote(lambda: 0).remote())  # a worker started by the raylet
ray_processes = [p for p in psutil.Process().children(recursive=True) if "reaper" not in " ".join(p.cmdline()[:3])]
print(len(ray_processes), sum(os.getpgid(p.pid) == os.getpgrp() for p in ray_processes), flush=True)
ray.shutdown()
"""


@pytest.mark.distributed
def test_a_signal_to_the_driver_s_process_group_does_not_reach_its_ray_cluster():
    """torchrun ends a learner with SIGTERM to its process group: the run's own Ray cluster (GCS, raylet, workers)
    is outside it, so that the learner says how the run stopped before it stops the cluster (it was inside: the
    raylet ended at once and the learner's core worker exited the process first, without that line)."""
    pytest.importorskip("ray", reason="the asynchronous mode needs Ray (the `async` extra)")
    folder = tempfile.mkdtemp(prefix="ray-")  # short: the cluster's socket paths must fit in 107 characters
    env = {**os.environ, "RAY_TMPDIR": folder, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", GROUPS_DRIVER], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    started, in_the_driver_s_group = map(int, done.stdout.split())
    assert started >= 3 and in_the_driver_s_group == 0
