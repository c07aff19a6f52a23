"""CPU threads: fast alone, graceful when the CPU is shared.

PyTorch's CPU kernels split each operation across a pool of threads (one per core) and wait for the slowest.
Alone that is fastest; beside another CPU-bound process (a second training, a reward server, a notebook) one
of the threads shares its core, every operation waits for it, and an epoch takes several times longer (3.7x
beside a busy loop, 5.2x for two trainings on 2 cores: `benchmarks/contention_bench.py`, docs/training.md).
Neither a shorter OpenMP spin count nor a passive wait policy fixes it without slowing the lone run: what
works is using only the cores that are free.

`ThreadGovernor` does that: before each epoch it measures how much of this process's CPUs other processes
used since the last look (`/proc/stat` minus this process's own CPU time) and sets torch's thread count to the
cores left over, between 1 and torch's own default; when the other work stops, the count goes back up.

Settings (`run.threads`): `auto` (the above, the default), an integer (a fixed count), or `torch` (leave
torch's threads alone). `OMP_NUM_THREADS` in the environment counts as a fixed choice, and
`FLOWRL_THREADING=torch` as `torch`. The thread count can change the last bits of CPU results on some
machines; fix it when a run must be bit-identical to another one on a shared machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch


STAT = Path("/proc/stat")
_governed = {"threads": None, "max": None}
"""The count the last governor set and its ceiling: a new governor in the same process starts from that ceiling,
not from a count lowered under load (unless someone else changed it since)."""


def _cpu_busy_seconds(cpus: set[int]) -> float | None:
    """Seconds the CPUs in `cpus` spent busy since boot (all processes), from /proc/stat; None where unreadable."""
    try:
        lines = STAT.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal: busy is everything but idle and iowait
        ticks = [int(v) for v in rest.split()[:8]]
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def check_setting(setting) -> None:
    """Refuse a `run.threads` value that is neither `auto`, `torch` nor a positive integer."""
    if isinstance(setting, bool) or not (setting in ("auto", "torch") or (isinstance(setting, int) and setting >= 1)):
        raise ValueError(f"run.threads must be 'auto', 'torch' or a positive integer, got {setting!r}")


class ThreadGovernor:
    """torch's CPU thread count, set to the cores other processes leave free (see the module docstring)."""

    def __init__(self, setting: str | int = "auto", min_interval_s: float = 1.0):
        self.min_interval_s = min_interval_s
        check_setting(setting)
        if os.environ.get("FLOWRL_THREADING", "").lower() == "torch":
            setting = "torch"
        elif setting == "auto" and os.environ.get("OMP_NUM_THREADS"):
            setting = "torch"  # the user fixed the count in the environment; torch already follows it
        if isinstance(setting, int):
            torch.set_num_threads(setting)
        current = torch.get_num_threads()
        lowered = current == _governed["threads"] and not isinstance(setting, int)
        self.max_threads = _governed["max"] if lowered else current
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.active = setting == "auto" and self.max_threads > 1 and _cpu_busy_seconds(self.cpus) is not None
        self.others = 0.0
        """Cores' worth of CPU time other processes used over the last interval."""
        self._mark = self._sample() if self.active else None

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    def _sample(self) -> tuple[float, float, float]:
        return self._now(), _cpu_busy_seconds(self.cpus) or 0.0, time.process_time()

    def adjust(self) -> int:
        """Set torch's thread count for the coming work from the load since the last call; returns it."""
        if not self.active:
            return torch.get_num_threads()
        now = self._sample()
        wall = now[0] - self._mark[0]
        if wall < self.min_interval_s:  # too short to tell another process from noise
            return torch.get_num_threads()
        busy, own = now[1] - self._mark[1], now[2] - self._mark[2]
        self._mark = now
        self.others = max(0.0, (busy - own) / wall)
        return self.apply(self.threads_for(self.others))

    def threads_for(self, others: float) -> int:
        """Threads for a machine where other processes use `others` cores: the free cores, rounded to nearest
        (a light background, under half a core, still leaves every core to flowrl), within [1, default]."""
        return max(1, min(self.max_threads, round(len(self.cpus) - others)))

    def apply(self, threads: int) -> int:
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        _governed.update(threads=threads, max=self.max_threads)
        return threads


def quiet_libraries(environ: dict | None = None) -> None:
    """Keep the `flowrl` command's output to flowrl's own lines: transformers' and diffusers' info and warning
    messages (torchvision notices on every import, "will try the local cache") only at their error level,
    unless the user chose a verbosity (`TRANSFORMERS_VERBOSITY`, `DIFFUSERS_VERBOSITY`); DeepSpeed's "Setting
    accelerator to CPU" warning, which its import prints on a machine without a GPU (accelerate imports it to unwrap
    models), is dropped."""
    import logging

    environ = os.environ if environ is None else environ
    environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    # DeepSpeed makes its logger at import (level, handler): a filter set on it now stays
    deepspeed = logging.getLogger("DeepSpeed")
    if _no_cpu_notice not in deepspeed.filters:
        deepspeed.addFilter(_no_cpu_notice)


def _no_cpu_notice(record) -> bool:
    return not record.getMessage().startswith("Setting accelerator to CPU")
