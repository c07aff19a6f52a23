"""Run state every trainer shares: seeding, processes, EMA weights and the resumable counters.

Nothing here knows about images, tokens or actions. Randomness is drawn from generators seeded by
`(run.seed, epoch, purpose, ...)`, so a resumed run draws exactly the numbers an uninterrupted one would; the
counters, the evaluation history and the metrics rows travel in `checkpoint` folders with the weights.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

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


class Processes:
    """This process's place among the run's processes (accelerate): its share of a batch and gathers.

    Args:
        accelerator (`accelerate.Accelerator`): the run's accelerator.
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator

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
        return self.accelerator.gather(t.to(self.device)).cpu()

    def gather_rows(self, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The rows of `t` where `mask` ([B] bool) holds, of every process, in rank order, on the CPU (as
        `gather`)."""
        if self.world == 1:
            return t[mask.to(t.device)].cpu()
        return self.gather(t)[self.gather(mask.long()).bool()]

    def gather_objects(self, obj) -> list:
        """`obj` (anything picklable: small diagnostics, never weights) from every process, in rank order."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sum(self, value: float) -> float:
        """`value` summed over the processes."""
        return float(self.gather(torch.tensor([float(value)])).sum())


class EMA:
    """Exponential moving average of parameters (`ema <- d ema + (1 - d) theta`); also a lagged copy with a
    decay that changes per update (DiffusionNFT's old policy). `prefix` names its tensors in checkpoints."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, prefix: str = "ema"):
        self.params, self.decay, self.prefix = params, decay, prefix
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """`shadow <- d shadow + (1 - d) theta` with `d = decay` (default: the constructor's)."""
        d = self.decay if decay is None else decay
        for shadow, p in zip(self.shadow, self.params):
            shadow.lerp_(p.detach(), 1 - d)

    @contextmanager
    def swapped(self):
        """Use the EMA weights inside the block."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{self.prefix}.{i}": t for i, t in enumerate(self.shadow)}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        for i, shadow in enumerate(self.shadow):
            shadow.copy_(tensors[f"{self.prefix}.{i}"])


@dataclasses.dataclass
class RunState:
    """The counters a resumed run continues from (saved as `trainer_state.json` in every checkpoint)."""

    trainer: str
    """The trainer that wrote it (a checkpoint of another trainer is refused)."""
    epoch: int = 0
    """Epochs completed."""
    optimizer_steps: int = 0
    """Optimizer steps taken (EMA updates count them)."""
    samples_scored: int = 0
    """Samples the training rewards scored: the run's reward budget."""
    nonfinite_steps: int = 0
    """Optimizer steps skipped because the gradient was NaN or infinite (`optim.max_nonfinite_steps`)."""
    eval_history: list[dict] = dataclasses.field(default_factory=list)
    """Every evaluation: `{"epoch": e, "eval/...": value}`."""
    metrics: list[dict] = dataclasses.field(default_factory=list)
    """Every epoch's metrics row (also `metrics.jsonl`)."""
    wall_s: float = 0.0
    """Training seconds before the last save."""
    best: dict | None = None
    """The best evaluation so far by `eval.best_metric`: `{"epoch", "metric", "value"}` (`checkpoints/best`)."""
    stopped: dict | None = None
    """Why the run stopped before `run.epochs` (`eval.stop_on_drop`): `{"epoch", "metric", "best", "value"}`."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RunState:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
