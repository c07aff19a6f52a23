"""What every part of a run shares, below the modalities: seeded randomness and this process's place in the group.

Randomness is drawn from generators seeded by `(run.seed, epoch, purpose, ...)`, so a resumed run draws exactly the
numbers an uninterrupted one would; per-sample generators (`row_generators`) make a sample's noise the same on one
process or many. `Processes` is this process's rank, the group's size and the collectives the loop uses (gathers
of small tensors and diagnostics); `Processes.single()` stands in where no process group exists (`flowrl sample`).
"""

from __future__ import annotations

import json

import torch


def seeded(*parts: int) -> torch.Generator:
    """A CPU generator seeded from integers (e.g. `(seed, epoch, purpose)`): resumed runs draw the same numbers."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part) + 1) % (2**63 - 1)
    return torch.Generator().manual_seed(value)


def row_generators(prefix: tuple[int, ...], rows) -> list[torch.Generator]:
    """One generator per sample, seeded by `(*prefix, row)` with `row` the sample's position in the whole
    batch of every process: a sample's noise is the same whichever process draws it and however the batch is
    split into calls (diffusers' `randn_tensor` draws row `i` from generator `i`)."""
    return [seeded(*prefix, int(row)) for row in rows]


class _Single:
    """The accelerator-shaped view of a lone process (rank 0 of 1, on the CPU or a given device)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.process_index, self.num_processes, self.is_main_process = 0, 1, True

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t


class Processes:
    """This process's place among the run's processes (accelerate): its share of a batch and gathers.

    Args:
        accelerator (`accelerate.Accelerator`): the run's accelerator (or `Processes.single()` without one).
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> Processes:
        """One process on its own, without accelerate (commands that only sample or score)."""
        return cls(_Single(torch.device(device)))

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def local_slice(self, n: int) -> slice:
        """This process's contiguous share of `n` rows (n must split evenly)."""
        if n % self.world:
            raise ValueError(f"{n} samples per epoch do not split over {self.world} processes")
        share = n // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """`t` from every process, concatenated in rank order, on the CPU."""
        if self.world == 1:
            return t.cpu()
        return self.accelerator.gather(t.to(self.device)).cpu()

    def gather_rows(self, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The rows of `t` where `mask` ([B] bool) holds, of every process, in rank order, on the CPU (as
        `gather`)."""
        if self.world == 1:
            return t[mask.to(t.device)].cpu()
        return self.gather(t)[self.gather(mask.long()).bool()]

    def gather_at(self, values: torch.Tensor, rows: torch.Tensor, size: int) -> torch.Tensor:
        """`[size, ...]` of every process's `values [B, ...]` placed at their `rows [B]` (positions in the batch of
        every process), on the CPU: each process's rows of a batch, assembled in the batch's order."""
        if self.world == 1 and len(rows) == size:
            return values.cpu()[torch.argsort(rows.cpu())]
        every_rows, every = self.gather(rows.long()), self.gather(values)
        out = torch.zeros((size, *values.shape[1:]), dtype=values.dtype)
        out[every_rows] = every
        return out

    def gather_json(self, obj) -> list:
        """`obj` (JSON-serialisable: small diagnostics, never weights) from every process, in rank order; it travels
        as JSON text in an integer tensor, never pickled."""
        if self.world == 1:
            return [obj]
        data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.int32)
        size = int(self.max(len(data)))
        padded = torch.zeros(size, dtype=torch.int32)
        padded[: len(data)] = data
        lengths = self.gather(torch.tensor([len(data)])).tolist()
        every = self.gather(padded).view(self.world, size)
        return [json.loads(bytes(every[r, : lengths[r]].tolist()).decode()) for r in range(self.world)]

    def sum(self, value: float) -> float:
        """`value` summed over the processes."""
        return self.sums(value)[0]

    def sums(self, *values: float) -> list[float]:
        """Each of `values` summed over the processes, in one collective."""
        if self.world == 1:
            return [float(v) for v in values]
        return self.gather(torch.tensor([[float(v) for v in values]])).sum(0).tolist()

    def max(self, value: float) -> float:
        """The largest `value` of any process."""
        if self.world == 1:
            return float(value)
        return float(self.gather(torch.tensor([float(value)])).max())


class RunContext:
    """What a modality's parts may use of the run: the processes, the device, mixed precision and the log.

    Args:
        processes (`Processes`): this process's place in the group.
        autocast (`Callable`, *optional*): a context-manager factory for mixed precision (None: none).
        log (`Callable`, *optional*): progress messages (None: silent; the main process of a run prints).
    """

    def __init__(self, processes: Processes, autocast=None, log=None):
        from contextlib import nullcontext

        self.processes = processes
        self.autocast = autocast or nullcontext
        self.log = log

    @classmethod
    def single(cls, device: str | torch.device = "cpu", log=print) -> RunContext:
        """A lone process without accelerate (`flowrl sample`, `flowrl eval`)."""
        return cls(Processes.single(device), log=log)

    @property
    def device(self) -> torch.device:
        return self.processes.device

    @property
    def is_main(self) -> bool:
        return self.processes.is_main
