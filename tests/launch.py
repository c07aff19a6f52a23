"""`flowrl` commands in processes forked from one that has imported flowrl's libraries already.

A `flowrl train` of the tiny test runs spends most of its time importing torch, diffusers, transformers and
matplotlib (about 7 of its 10 s on two cores), and a two-process test starts four such interpreters (the
one-process reference, torchrun's agent and its two workers). `start` forks each process from a multiprocessing
forkserver that imported them once for the whole pytest session, and forms the group of `processes` the way
torchrun does for its workers (the same RANK, LOCAL_RANK, WORLD_SIZE and MASTER_* variables, so the run's own
`init_process_group` builds the same gloo group); `start_code` forks one for a piece of Python source. The tests of
the launcher itself (torchrun, signals, restarts) still start real ones. Each child replaces its environment with
`env` and writes its output to `log`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path


PRELOAD = [
    "flowrl.cli",
    "flowrl.trainers",
    "flowrl.digits",
    "accelerate",
    "peft",
    "transformers.modeling_layers",
    "diffusers.models.transformers",
    "diffusers.schedulers.scheduling_flow_match_euler_discrete",  # with scipy.stats
    "matplotlib.pyplot",
]
"""What the forkserver imports before it forks anything: every run's libraries (a run imports the rest itself)."""

_CONTEXT: multiprocessing.context.BaseContext | None = None


def _context():
    """The session's forkserver, started once with one OpenMP thread (libgomp reads OMP_NUM_THREADS as torch
    loads, which here happens in the server, not in the forked runs)."""
    global _CONTEXT
    if _CONTEXT is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _CONTEXT = context
    return _CONTEXT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FLOWRL = "import sys\nfrom flowrl.cli import main\n\nsys.exit(main(sys.argv[1:]))\n"
"""The source of `flowrl ARGV` (its command line in `sys.argv`)."""


def _exec(code: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """The child: the Python source `code` with `argv` as `sys.argv` and `env` as its whole environment, stdout and
    stderr appended to `log`."""
    os.environ.clear()
    os.environ.update(env)
    sink = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    sys.argv = list(argv)
    try:
        exec(compile(code, "<launch.start_code>", "exec"), {"__name__": "__main__"})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


@dataclass
class Launched:
    """The processes of one `start`: rank order, all of one run."""

    processes: list
    log: Path

    def wait(self, timeout: float = 600) -> int:
        """Wait for every process and give the run's exit code: the first non-zero one (the others are stopped
        then, as torchrun stops a group whose worker failed), 0 when all succeeded. Past `timeout` every process
        is killed and TimeoutError raised."""
        deadline = time.monotonic() + timeout
        running = list(self.processes)
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise TimeoutError(f"the run did not end within {timeout} s; its log: {self.log}")
            for sentinel in wait([p.sentinel for p in running], timeout=left):
                process = next(p for p in running if p.sentinel == sentinel)
                process.join()
                running.remove(process)
                if process.exitcode != 0:
                    self.stop()
                    return process.exitcode
        return 0

    def stop(self, grace: float = 10) -> None:
        """SIGTERM to whatever still runs, SIGKILL after `grace` seconds."""
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        for process in self.processes:
            process.join(grace)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()


def start(argv: list[str], env: dict[str, str], log: Path, processes: int = 1) -> Launched:
    """Start `flowrl ARGV` on `processes` forked processes (one gloo group when more than one)."""
    return start_code(FLOWRL, env, log, processes, argv=["flowrl", *argv])


def start_code(code: str, env: dict[str, str], log: Path, processes: int = 1, argv=("-c",)) -> Launched:
    """Start the Python source `code` with the command line `argv` (`sys.argv`) on `processes` forked processes (as
    `python -c CODE ARGS` or `torchrun ... -c CODE ARGS` would run it, without the imports)."""
    context = _context()
    log.write_text("")
    group = {}
    if processes > 1:
        group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(processes)}
        group |= {"LOCAL_WORLD_SIZE": str(processes), "GROUP_RANK": "0"}
    started = []
    for rank in range(processes):
        ranked = {**env, **group, **({"RANK": str(rank), "LOCAL_RANK": str(rank)} if group else {})}
        process = context.Process(target=_exec, args=(code, list(argv), ranked, str(log)), name=f"flowrl-rank{rank}")
        process.start()
        started.append(process)
    return Launched(started, log)


def run(argv: list[str], env: dict[str, str], log: Path, timeout: float = 600) -> tuple[int, str]:
    """`flowrl ARGV` in one forked process, waited for: its exit code and output."""
    code = start(argv, env, log).wait(timeout)
    return code, log.read_text()
