"""The update of one minibatch on `[b, K]`: every modality's elements reach the core in one call.

A trainer describes its minibatch by the elements each row trains, `index [b, k]` (denoising steps, FPO
draws, the initial noise; tokens), out of `K` per row, and a `score(columns)` hook that returns the
per-element loss inputs of some of those columns as `Terms` (`[b, c]` each). This module lays them out as
masked `[b, K]` tensors (element `t` of a row in column `t`, so the core's per-step metrics are per
denoising step whatever the selection), calls `compute_policy_loss` once with the mask, the per-element
weights and the objective's aggregation, adds the per-element regularisers aggregated the same way, and
runs the backward pass:

- `whole`: all `k` columns scored with gradient at once, one loss, one backward;
- `per_step`: one column at a time, one backward each, so one column's activations are in memory. Every
  aggregation is a mask-weighted sum (`flowrl.core.aggregation_weights`), so for element-wise objectives a
  column's share of the loss is its per-element loss times those weights. For objectives that couple the K
  axis (GSPO's sequence ratio) a no-grad pass over all columns first fixes the coefficients
  `dL/d(logp, inputs, penalties) [b, K]`; each column's backward then uses them. Both modes give the
  gradient of the same loss (up to float rounding; `tests/trainers/test_update.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from flowrl.core import aggregation_weights, compute_policy_loss, get_objective
from flowrl.core.objectives import uses_batch_statistics
from flowrl.tracking import scalar


@dataclasses.dataclass
class Terms:
    """Per-element inputs of a minibatch's loss for `c` of its columns: every tensor is `[b, c]`."""

    logp: torch.Tensor | None = None
    """Log-probabilities under the current policy (carry the gradient); None for trainers without a ratio."""
    old_logp: torch.Tensor | None = None
    """Behaviour-policy log-probabilities."""
    inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per-element hyper-parameters of the objective (GRPO-Guard's `std` and `mean_diff_sq`, which carries
    the gradient of the current mean)."""
    penalty: torch.Tensor | None = None
    """A per-element regulariser, already weighted (`beta * KL`), added to the loss with the objective's
    aggregation."""
    loss: torch.Tensor | None = None
    """A per-element loss of a trainer without a ratio objective (AC-Flow's weighted flow matching)."""
    weight: torch.Tensor | None = None
    """Per-element weights of the policy loss (`steps.weighting`), no gradient."""
    logs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per-element diagnostics, logged as their mean over the minibatch's elements (e.g. `kl`)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by a flat name (`logp`, `inputs.std`, `logs.kl`, ...)."""
        out = {f: getattr(self, f) for f in ("logp", "old_logp", "penalty", "loss", "weight")}
        out.update({f"inputs.{k}": v for k, v in self.inputs.items()})
        out.update({f"logs.{k}": v for k, v in self.logs.items()})
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Terms:
        terms = cls()
        for name, value in tensors.items():
            if "." in name:
                group, key = name.split(".", 1)
                getattr(terms, group)[key] = value
            else:
                setattr(terms, name, value)
        return terms

    @classmethod
    def cat(cls, parts: list[Terms]) -> Terms:
        """Columns side by side."""
        tensors = [p.tensors() for p in parts]
        return cls.from_tensors({k: torch.cat([t[k] for t in tensors], dim=1) for k in tensors[0]})


DIFFERENTIABLE = ("logp", "penalty", "loss")
"""The `Terms` fields that carry the policy's gradient (besides floating `inputs`)."""


def normaliser(agg: str, rows: int, elements: int) -> float:
    """The count a minibatch's aggregated loss is normalised by: its elements (`token_mean`), its rows (the
    `seq_mean_*` modes) or 1 (`sum`). Minibatches of an accumulation window are weighted by their share."""
    if agg == "token_mean":
        return float(elements)
    if agg == "sum":
        return 1.0
    return float(rows)


def minibatch_update(
    score: Callable[[torch.Tensor], Terms],
    index: torch.Tensor,
    num_elements: int,
    advantages: torch.Tensor | None,
    *,
    objective: str | None,
    hparams: dict[str, Any] | None = None,
    per_step: bool = False,
    scale: float = 1.0,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    valid: torch.Tensor | None = None,
    probe: GradProbe | None = None,
) -> dict[str, torch.Tensor]:
    """Loss of one minibatch on `[b, K]`, back-propagated with `scale`; returns its (detached) metrics.

    Args:
        score (`Callable`): `score(columns [c]) -> Terms` with `[b, c]` tensors for those columns of `index`.
        index (`torch.Tensor`): `[b, k]` element each row trains in each column, in `[0, num_elements)`.
        num_elements (`int`): K, the elements per row (denoising steps, draws, tokens).
        advantages (`torch.Tensor`): `[b]` or `[b, K]` (dense, per element); None without an objective.
        objective (`str`): a registered objective, or None when `Terms.loss` is the whole policy loss.
        hparams (`dict`): the objective's hyper-parameters (`agg`, `norm_len`, clip ranges, ...).
        per_step (`bool`): one backward per column (see the module docstring) instead of one in all.
        scale (`float`): the minibatch's weight in the accumulation window (multiplies every backward).
        backward (`Callable`): runs the backward pass of a scalar (the trainer's `accelerator.backward`).
        valid (`torch.Tensor`, *optional*): `[b, k]` bool, False for padding columns of a row.
        probe (`GradProbe`, *optional*): with `per_step` and an element-wise objective, measure each column's
            gradient norm (`grad_norm_per_step [K]`, NaN where a column mixes elements).

    Returns:
        `loss`, `pg_loss` (the objective's part), the core's metrics (`clipfrac`, ..., per-step rows) and the
        masked means of `Terms.logs`, all detached.
    """
    hp = dict(hparams or {})
    spec = get_objective(objective) if objective is not None else None
    agg = hp.get("agg", spec.agg if spec is not None else "token_mean")
    b, k = index.shape
    layout = _Layout(index, num_elements, valid, agg, hp.get("norm_len"))
    columns = torch.arange(k)
    if not per_step or k == 1:
        terms = score(columns)
        loss, metrics = _loss(terms, layout, advantages, objective, hp)
        backward(loss * scale)
        return _detached(loss, metrics)

    if spec is None or spec.elementwise and not uses_batch_statistics(spec, hp):  # one column's loss is its own
        parts = []
        norms = torch.full((num_elements,), float("nan"))
        if probe is not None:
            probe.reset()
        for j in range(k):
            terms = score(columns[j : j + 1])
            part = _loss(terms, layout.column(j), advantages, objective, {**hp, "agg": "sum"}, weighted=True)[0]
            backward(part * scale)
            parts.append(_detach_terms(terms))
            if probe is not None:
                norm = probe.increment_norm() / scale
                element = index[:, j][layout.valid[:, j]].unique()
                if element.numel() == 1:  # one denoising step in this column: its norm is that step's
                    norms[element] = norm
        with torch.no_grad():
            loss, metrics = _loss(Terms.cat(parts), layout, advantages, objective, hp)
        if probe is not None:
            metrics["grad_norm_per_step"] = norms
        return _detached(loss, metrics)

    # a coupled objective: fix dL/d(terms) from a no-grad pass over every column, then one backward per column
    with torch.no_grad():
        values = score(columns).tensors()
    names = [n for n, v in values.items() if _carries_gradient(n) and v.is_floating_point()]
    leaves = {n: v.detach().requires_grad_(True) for n, v in values.items() if n in names}
    leaf_terms = Terms.from_tensors({**values, **leaves})
    loss, metrics = _loss(leaf_terms, layout, advantages, objective, hp)
    coefs = dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)))
    for j in range(k):
        column = score(columns[j : j + 1]).tensors()
        surrogate = [(coefs[n][:, j : j + 1] * column[n]).sum() for n in names
                     if coefs[n] is not None and column[n].requires_grad]  # fmt: skip
        if surrogate:
            backward(torch.stack(surrogate).sum() * scale)
    return _detached(loss, metrics)


class GradProbe:
    """The norm of what each backward pass adds to the parameters' gradients (per-step gradient norms)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        self.before: list[torch.Tensor | None] = []

    def reset(self) -> None:
        """Remember the gradients as they are now."""
        self.before = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    def increment_norm(self) -> float:
        """`||grad - grad at the last call||` (fp32), and remember the gradients as they are now."""
        total = torch.zeros((), dtype=torch.float32)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad.detach()
            delta = grad if self.before[i] is None else grad - self.before[i]
            total += delta.float().square().sum().cpu()
            self.before[i] = grad.clone()
        return float(total.sqrt())


def _carries_gradient(name: str) -> bool:
    return name in DIFFERENTIABLE or name.startswith("inputs.")


class _Layout:
    """Where a minibatch's columns land in the dense `[b, K]` layout, and the aggregation weights there."""

    def __init__(self, index, num_elements, valid, agg, norm_len, weights=None):
        self.index = index.long()
        self.num_elements = num_elements
        self.valid = torch.ones_like(self.index, dtype=torch.bool) if valid is None else valid.bool()
        if (self.index < 0).any() or (self.index >= num_elements).any():
            raise ValueError(f"element indices must lie in [0, {num_elements}), got {self.index.unique().tolist()}")
        self.mask = torch.zeros(self.index.shape[0], num_elements, dtype=torch.bool).scatter_(1, self.index,
                                                                                             self.valid)  # fmt: skip
        self.weights = aggregation_weights(self.mask, agg, norm_len=norm_len) if weights is None else weights

    def column(self, j: int) -> _Layout:
        """The layout of column `j` alone, keeping the whole minibatch's aggregation weights."""
        return _Layout(self.index[:, j : j + 1], self.num_elements, self.valid[:, j : j + 1], "sum", None,
                       weights=self.weights)  # fmt: skip

    def dense(self, t: torch.Tensor) -> torch.Tensor:
        """`[b, c]` values of the columns -> `[b, K]` (0 elsewhere); differentiable in `t`."""
        index = self.index.to(t.device)
        return torch.zeros(t.shape[0], self.num_elements, dtype=t.dtype, device=t.device).scatter(1, index, t)


def _loss(terms: Terms, layout: _Layout, advantages, objective, hp, weighted: bool = False):
    """The minibatch loss (or, `weighted`, a column's share of it: `agg` is then `sum` and the per-element
    losses carry the whole minibatch's aggregation weights) and the core's metrics."""
    device = next(iter(terms.tensors().values())).device
    mask = layout.mask.to(device)
    agg_weights = layout.weights.to(device)
    weight = layout.dense(terms.weight.float()) if terms.weight is not None else None
    metrics: dict[str, torch.Tensor] = {}
    loss = torch.zeros((), device=device)
    if objective is not None:
        if terms.logp is None or terms.old_logp is None:
            raise ValueError(f"objective {objective!r} needs Terms.logp and Terms.old_logp")
        inputs = {name: layout.dense(v) for name, v in terms.inputs.items()}
        adv = advantages.to(device)
        if weighted:
            weight = agg_weights if weight is None else weight * agg_weights
        loss, metrics = compute_policy_loss(objective, layout.dense(terms.logp), layout.dense(terms.old_logp), adv,
                                            mask, weights=weight, **{**hp, **inputs})  # fmt: skip
        metrics["pg_loss"] = loss.detach()
        metrics["approx_kl"] = metrics.pop("approx_kl_k3")
    if terms.loss is not None:
        per_element = layout.dense(terms.loss.float())
        if weight is not None and objective is None:
            per_element = per_element * weight
        loss = loss + (agg_weights * per_element).sum()
    if terms.penalty is not None:
        penalty = (agg_weights * layout.dense(terms.penalty.float())).sum()
        loss = loss + penalty
        metrics["penalty"] = penalty.detach()
    fmask = mask.float()
    for name, value in terms.logs.items():
        metrics[name] = (layout.dense(value.detach().float()) * fmask).sum() / fmask.sum().clamp_min(1.0)
    return loss, metrics


def _detach_terms(terms: Terms) -> Terms:
    return Terms.from_tensors({k: v.detach() for k, v in terms.tensors().items()})


def _detached(loss, metrics) -> dict[str, torch.Tensor]:
    return {"loss": loss.detach(), **{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}}


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
    """Accumulates minibatch metrics into epoch means; per-step rows are pooled with their element counts, so
    `ratio_std/step_t` is the spread over every element of step t in the epoch, whatever the minibatches.

    A minibatch's scalars are weighted by `weight` (its trained elements: a scalar's epoch value is then its
    mean over the epoch's elements, however they were cut into minibatches and processes). `summary(processes)`
    pools every process's sums, except the `shared` scalars every process already holds alike (the gradient
    norm after the reduction)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self.shared: set[str] = set()
        self.steps: dict[str, torch.Tensor] = {}  # pooled sums per step: count, mean, second moment per row

    def add_scalar(self, key: str, value, weight: float = 1.0, shared: bool = False) -> None:
        """One value of `key` with its weight; `shared`: the same on every process (not pooled over them)."""
        value = scalar(value)
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, float) and math.isfinite(value):
            self.sums[key] = self.sums.get(key, 0.0) + value * weight
            self.counts[key] = self.counts.get(key, 0.0) + weight
            if shared:
                self.shared.add(key)

    def add(self, metrics: dict, weight: float = 1.0, loss_weight: float | None = None) -> None:
        """A minibatch's metrics: scalars weighted by `weight` (its elements) and the aggregated losses by
        `loss_weight` (the aggregation's normaliser: rows for the `seq_mean_*` modes; default `weight`), and the
        core's per-step rows when it returned them."""
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1 or key.endswith("_per_step"):
                continue
            losses = key in LOSSES and loss_weight is not None
            self.add_scalar(key, value, loss_weight if losses else weight)
        norms = metrics.get("grad_norm_per_step")
        if norms is not None:
            for t in torch.isfinite(norms).nonzero().flatten().tolist():
                self.add_scalar(f"grad_norm/step_{t}", float(norms[t]))
        count = metrics.get("count_per_step")
        if count is None:
            return
        count = count.detach().double().cpu()
        rows = {}
        for name in ("ratio", "raw_ratio"):
            mean = metrics[f"{name}_mean_per_step"].detach().double().cpu()
            std = metrics[f"{name}_std_per_step"].detach().double().cpu()
            rows[name] = torch.stack([count * mean, count * (std**2 + mean**2)])
        rows["clipfrac"] = (count * metrics["clipfrac_per_step"].detach().double().cpu())[None]
        rows["count"] = count[None]
        for name, value in rows.items():
            if name in self.steps and self.steps[name].shape[-1] != value.shape[-1]:
                raise ValueError(f"per-step metrics over {value.shape[-1]} steps after {self.steps[name].shape[-1]}")
            self.steps[name] = self.steps[name] + value if name in self.steps else value

    def pool(self, processes) -> None:
        """Add every other process's sums to this one's (every process then holds the whole epoch's)."""
        if processes is None or processes.world == 1:
            return
        mine = {
            "sums": {k: v for k, v in self.sums.items() if k not in self.shared},
            "counts": {k: v for k, v in self.counts.items() if k not in self.shared},
            "steps": self.steps,
        }
        sums, counts, steps = {}, {}, {}
        for part in processes.gather_objects(mine):
            for key, value in part["sums"].items():
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0.0) + part["counts"][key]
            for name, value in part["steps"].items():
                steps[name] = _add_padded(steps[name], value) if name in steps else value
        for key in self.shared:  # the same on every process: kept as they are
            sums[key], counts[key] = self.sums[key], self.counts[key]
        self.sums, self.counts, self.steps = sums, counts, steps

    def summary(self, processes=None) -> dict[str, Any]:
        """Epoch means; with `processes`, over every process's minibatches (a collective call: all must call)."""
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
