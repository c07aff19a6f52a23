"""Run state every trainer shares: EMA weights and the resumable counters.

Nothing here knows about images, tokens or actions. The counters, the evaluation history and the metrics rows
travel in `checkpoint` folders with the weights (seeding and the process group: `flowrl.runtime`).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch


class EMA:
    """Exponential moving average of parameters (`ema <- d ema + (1 - d) theta`); also a lagged copy with a
    decay that changes per update (DiffusionNFT's old policy). `prefix` names its tensors in checkpoints.

    Over FSDP2's sharded parameters (DTensors) each process keeps and updates the shadow of its own shard, so the
    EMA is sharded like the weights; checkpoints hold it in full."""

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
        """The shadow weights in full (a sharded run's are gathered: a collective, every process calls it)."""
        return {f"{self.prefix}.{i}": _full(t) for i, t in enumerate(self.shadow)}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Full shadow weights (as `state_dict` gave them), each process keeping its shard of a sharded run's."""
        for i, shadow in enumerate(self.shadow):
            value = tensors[f"{self.prefix}.{i}"]
            if hasattr(shadow, "device_mesh"):  # FSDP2: this process's shard of the full tensor
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(
                    value.to(shadow.device_mesh.device_type), shadow.device_mesh, shadow.placements
                )
            shadow.copy_(value)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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
