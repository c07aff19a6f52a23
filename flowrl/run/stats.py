"""Epoch diagnostics of the update: batch metrics pooled over micro-batches, mini-batches and processes."""

from __future__ import annotations

import math
from typing import Any

import torch

from flowrl.tracking import scalar


PER_STEP = {
    "ratio_mean": "ratio_mean_per_step",
    "ratio_std": "ratio_std_per_step",
    "raw_ratio_mean": "raw_ratio_mean_per_step",
    "raw_ratio_std": "raw_ratio_std_per_step",
    "clipfrac": "clipfrac_per_step",
}
"""Logged per-step rows (`ratio_mean/step_t`, ...) and the core metric each comes from."""


LOSSES = ("loss", "pg_loss", "penalty")
"""Minibatch metrics that are aggregated losses (normalised like the loss, not per element)."""


class EpochStats:
    """Accumulates micro-batch metrics into epoch means; per-step rows are pooled with their element counts, so
    `ratio_std/step_t` is the spread over every element of step t in the epoch, whatever the micro-batches.

    A micro-batch's scalars are weighted by `weight` (its trained elements: a scalar's epoch value is then its
    mean over the epoch's elements, however they were cut into micro-batches and processes). `summary(processes)`
    pools every process's sums, except the `shared` scalars every process already holds alike (the gradient
    norm after the reduction).

    Metrics that are device tensors stay on their device (fp64 sums, a non-finite value skipped by a mask) until
    `summary`, which reads them back once: the update's step loop never waits for the device."""

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = {}
        self.counts: dict[str, float | torch.Tensor] = {}
        self.shared: set[str] = set()
        self.steps: dict[str, torch.Tensor] = {}  # pooled sums per step: count, mean, second moment per row

    def add_scalar(self, key: str, value, weight: float = 1.0, shared: bool = False) -> None:
        """One value of `key` with its weight; `shared`: the same on every process (not pooled over them)."""
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.detach().reshape(()).double()
            finite = torch.isfinite(value)  # a NaN or inf is skipped, as for numbers below
            self.sums[key] = self.sums.get(key, 0.0) + torch.where(finite, value * weight, 0.0)
            self.counts[key] = self.counts.get(key, 0.0) + finite.double() * weight
        else:
            value = scalar(value)
            if isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not (isinstance(value, float) and math.isfinite(value)):
                return
            self.sums[key] = self.sums.get(key, 0.0) + value * weight
            self.counts[key] = self.counts.get(key, 0.0) + weight
        if shared:
            self.shared.add(key)

    def add(self, metrics: dict, weight: float = 1.0, loss_weight: float | None = None) -> None:
        """A micro-batch's metrics: scalars weighted by `weight` (its elements) and the aggregated losses by
        `loss_weight` (the aggregation's normaliser: rows for the `seq_mean_*` modes; default `weight`), and the
        core's per-step rows when it returned them."""
        keys = [
            k
            for k, v in metrics.items()
            if not k.endswith("_per_step") and not (isinstance(v, torch.Tensor) and v.numel() > 1)
        ]
        for key in keys:
            losses = key in LOSSES and loss_weight is not None
            self.add_scalar(key, metrics[key], loss_weight if losses else weight)
        norms = metrics.get("grad_norm_per_step")
        if norms is not None:
            for t in torch.isfinite(norms).nonzero().flatten().tolist():
                self.add_scalar(f"grad_norm/step_{t}", float(norms[t]))
        count = metrics.get("count_per_step")
        if count is None:
            return
        count = count.detach().double()
        rows = {}
        for name in ("ratio", "raw_ratio"):
            mean = metrics[f"{name}_mean_per_step"].detach().double()
            std = metrics[f"{name}_std_per_step"].detach().double()
            rows[name] = torch.stack([count * mean, count * (std**2 + mean**2)])
        rows["clipfrac"] = (count * metrics["clipfrac_per_step"].detach().double())[None]
        rows["count"] = count[None]
        for name, value in rows.items():
            if name in self.steps and self.steps[name].shape[-1] != value.shape[-1]:
                raise ValueError(f"per-step metrics over {value.shape[-1]} steps after {self.steps[name].shape[-1]}")
            self.steps[name] = self.steps[name] + value.to(self.steps[name]) if name in self.steps else value

    def to_host(self) -> None:
        """Read the device sums back (one copy per device for the scalars)."""
        for table in (self.sums, self.counts):
            tensors = [k for k, v in table.items() if isinstance(v, torch.Tensor)]
            if tensors:
                values = torch.stack([table[k].double() for k in tensors]).cpu().tolist()
                table.update(zip(tensors, values))
        self.steps = {k: v.cpu() for k, v in self.steps.items()}

    def pool(self, processes) -> None:
        """Add every other process's sums to this one's (every process then holds the whole epoch's)."""
        self.to_host()
        if processes is None or processes.world == 1:
            return
        mine = {
            "sums": {k: v for k, v in self.sums.items() if k not in self.shared},
            "counts": {k: v for k, v in self.counts.items() if k not in self.shared},
            "steps": {k: v.tolist() for k, v in self.steps.items()},
        }
        sums, counts, steps = {}, {}, {}
        for part in processes.gather_json(mine):
            for key, value in part["sums"].items():
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0.0) + part["counts"][key]
            for name, value in part["steps"].items():
                value = torch.tensor(value, dtype=torch.float64)
                steps[name] = _add_padded(steps[name], value) if name in steps else value
        for key in self.shared:  # the same on every process: kept as they are
            sums[key], counts[key] = self.sums[key], self.counts[key]
        self.sums, self.counts, self.steps = sums, counts, steps

    def summary(self, processes=None) -> dict[str, Any]:
        """Epoch means; with `processes`, over every process's micro-batches (a collective call: all must call)."""
        self.pool(processes)
        out = {k: self.sums[k] / self.counts[k] for k in self.sums if self.counts[k] > 0}
        if not self.steps:
            return out
        count = self.steps["count"][0]
        for t in (count > 0).nonzero().flatten().tolist():
            n = float(count[t])
            for name in ("ratio", "raw_ratio"):
                first, second = (float(x) / n for x in self.steps[name][:, t])
                out[f"{name}_mean/step_{t}"] = first
                out[f"{name}_std/step_{t}"] = math.sqrt(max(second - first * first, 0.0))
            out[f"clipfrac/step_{t}"] = float(self.steps["clipfrac"][0, t]) / n
        return out


def _add_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a + b` over the last axis, the shorter one padded with zeros (processes' text widths differ)."""
    width = max(a.shape[-1], b.shape[-1])
    pad = torch.nn.functional.pad
    return pad(a, (0, width - a.shape[-1])) + pad(b, (0, width - b.shape[-1]))
