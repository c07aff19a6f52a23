"""The Ray cluster an asynchronous run starts for itself (`asynchrony.address: null`): on this machine only, and gone
with the run.

- **Loopback only.** Ray binds its processes (GCS, raylet, object manager, workers, the driver's core worker) to the
  node's IP address, found by asking the network (`0.0.0.0` listeners reachable from the LAN). A cluster the run
  starts for itself has no other machine to talk to: it gets `127.0.0.1` as its node address (Ray's own choice on
  machines where it does not form clusters), so that Ray's servers listen on the loopback interface.
- **Its own.** `ray.init()` without an address joins the cluster `RAY_ADDRESS` or the last `ray start` on this machine
  recorded (its `ray_current_cluster` file, which a killed head leaves behind); the run's cluster is started with
  `address="local"`, which never does.
- **Its own process groups.** Ray starts its GCS and raylet (and the raylet its workers) in the driver's process
  group, so a launcher's SIGTERM to the group (torchrun's to each learner's) reached them too: the raylet ended, and
  the driver's core worker exited the process (code 1) before its own SIGTERM handler had said how the run stopped.
  The run's cluster is started in sessions of its own; the driver stops it as it stops.
- **Reaped.** Ray ends its processes when the driver calls `ray.shutdown()`, and the GCS and raylet when the driver
  dies; but the raylet's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`), orphaned when a driver is killed
  with SIGKILL, wait a minute for the dead GCS before they exit. A small reaper process, started beside the cluster,
  waits for the driver to end (the pipe it reads closes, however the driver ends, and it is handed to another parent)
  and then kills every Ray process (a `ray::` title, or a program of the installed `ray` package) that still holds a
  file of the cluster's session folder open. Only Ray's: another process reading the folder (a `tail -f` of a log, a
  test removing the folder) is left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock


_REAPER = r"""
import os, signal, sys, time
session, package, me, driver = sys.argv[1], sys.argv[2], os.getpid(), os.getppid()
sys.stdin.buffer.read()  # returns when the driver's end of the pipe closes: it died, or it is exiting
while os.getppid() == driver:  # until it is gone (this process is then handed to another parent)
    time.sleep(0.1)
time.sleep(1.0)  # a clean ray.shutdown() ends them itself

def holders():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in (me, driver):
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            # Ray's own: a titled process (`ray::DashboardAgent`, `ray::IDLE`) or a program of the ray package (GCS,
            # raylet, `python -u .../ray/_private/log_monitor.py`); a user's process reading the folder is not
            if not (argv[0].startswith("ray::") or any(arg.startswith(package) for arg in argv[:3])):
                continue
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(link.startswith(session) for link in links):
            yield int(pid)

for _ in range(10):
    found = list(holders())
    if not found:
        break
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.2)
"""

_reapers: list[subprocess.Popen] = []  # their pipes stay open while the driver lives


def start_local_cluster(ray, **init_kwargs):
    """`ray.init(**init_kwargs)` of a new local cluster bound to the loopback interface, with a reaper (see the
    module docstring); returns what `ray.init` returns."""
    init_kwargs = {**init_kwargs, "address": "local"}  # a new cluster, never one found on this machine
    from ray._private import ray_constants, services

    class _OwnSessionPopen(services.ConsolePopen):  # the processes `ray.init` starts, in sessions of their own
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, start_new_session=True)

    saved = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(_CLUSTER_ENV)
    # Ray's node address: 127.0.0.1 where it does not form clusters (read when ray.init picks the node's address;
    # the environment variable is what the processes it starts read)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_CLUSTER_ENV] = "0"
    try:
        with mock.patch.object(services, "ConsolePopen", _OwnSessionPopen):
            context = ray.init(**init_kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved[0]
        if saved[1] is None:
            os.environ.pop(_CLUSTER_ENV, None)
        else:
            os.environ[_CLUSTER_ENV] = saved[1]
    session = context.address_info.get("session_dir")
    if session and os.path.isdir("/proc/self/fd"):
        package = os.path.join(os.path.dirname(os.path.abspath(ray.__file__)), "")
        command = [sys.executable, "-c", _REAPER, os.path.join(session, ""), package]
        reaper = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _reapers.append(reaper)
    return context


_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
