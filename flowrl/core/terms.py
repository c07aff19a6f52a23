"""A batch's loss inputs on `[b, K]` and the loss they give: what every modality hands the objective core.

An algorithm describes a batch by the elements each row trains, `index [b, k]` (denoising steps, flow-matching
draws, the initial noise; tokens; a control action's steps), out of `K` per row, and returns their per-element
loss inputs as `Terms` (`[b, c]` each, for `c` of those columns). `ElementLayout` places columns in the dense
`[b, K]` layout (element `t` of a row in column `t`, so the core's per-step metrics are per denoising step whatever
the selection) with the aggregation's weights, and `terms_loss` makes the loss: one `compute_policy_loss` call with
the mask, per-element weights and the objective's aggregation, plus the per-element penalties and losses aggregated
the same way; a per-row loss (`Terms.row_loss`, control's value loss) is returned apart, since it is averaged over
rows, not elements.

Pure tensor functions: the update scheduler (`flowrl.run.scheduler`) decides which rows form a batch, how its
losses are scaled into a global mini-batch and where the backward passes run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flowrl.core.aggregation import aggregation_weights
from flowrl.core.copies import to_device
from flowrl.core.policy_loss import compute_policy_loss


@dataclasses.dataclass
class Terms:
    """Per-element inputs of a batch's loss for `c` of its columns: every tensor is `[b, c]` (`row_loss`: `[b]`)."""

    logp: torch.Tensor | None = None
    """Log-probabilities under the current policy (carry the gradient); None for trainers without a ratio."""
    old_logp: torch.Tensor | None = None
    """Behaviour-policy log-probabilities."""
    inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per-element hyper-parameters of the objective (GRPO-Guard's `std` and `mean_diff_sq`, which carries
    the gradient of the current mean; text's `entropy`, `segment_ids`)."""
    penalty: torch.Tensor | None = None
    """A per-element regulariser, already weighted (`beta * KL`), added to the loss with the objective's
    aggregation."""
    loss: torch.Tensor | None = None
    """A per-element loss of a trainer without a ratio objective (AC-Flow's weighted flow matching, NFT's)."""
    weight: torch.Tensor | None = None
    """Per-element weights of the policy loss (`steps.weighting`), no gradient."""
    row_loss: torch.Tensor | None = None
    """`[b]` a per-row loss averaged over the mini-batch's rows, apart from the elements (control's weighted value
    loss); given with the first column only."""
    logs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Per-element diagnostics, logged as their mean over the batch's elements (e.g. `kl`)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by a flat name (`logp`, `inputs.std`, `logs.kl`, ...)."""
        out = {f: getattr(self, f) for f in ("logp", "old_logp", "penalty", "loss", "weight", "row_loss")}
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
    def cat(cls, parts: list[Terms], dim: int = 1) -> Terms:
        """Columns side by side (`dim=1`), or rows one below the other (`dim=0`); `row_loss` is kept from the parts
        that have it (columns) or stacked (rows)."""
        tensors = [p.tensors() for p in parts]
        names = dict.fromkeys(k for t in tensors for k in t)
        out = {}
        for name in names:
            values = [t[name] for t in tensors if name in t]
            if name == "row_loss" and dim == 1:
                out[name] = values[0]
            else:
                out[name] = torch.cat(values, dim=0 if name == "row_loss" else dim)
        return cls.from_tensors(out)

    def detached(self) -> Terms:
        return Terms.from_tensors({k: v.detach() for k, v in self.tensors().items()})


DIFFERENTIABLE = ("logp", "penalty", "loss", "row_loss")
"""The `Terms` fields that carry the policy's gradient (besides floating `inputs`)."""


def carries_gradient(name: str) -> bool:
    """Whether the flat `Terms` name `name` can carry the policy's gradient."""
    return name in DIFFERENTIABLE or name.startswith("inputs.")


def normaliser(agg: str, rows: int, elements: int) -> float:
    """The count a batch's aggregated loss is normalised by: its elements (`token_mean`), its rows (the `seq_mean_*`
    modes) or 1 (`sum`). Batches of one mini-batch are weighted by their share of it."""
    if agg == "token_mean":
        return float(elements)
    if agg == "sum":
        return 1.0
    return float(rows)


class ElementLayout:
    """Where a batch's columns land in the dense `[b, K]` layout, and the aggregation weights there.

    Args:
        index (`torch.Tensor`): `[b, k]` the element each row trains in each column, in `[0, num_elements)`.
        num_elements (`int`): K.
        valid (`torch.Tensor`, *optional*): `[b, k]` bool, False for padding.
        agg (`str`): the objective's aggregation; `norm_len` its constant length (Dr.GRPO).
    """

    def __init__(self, index, num_elements, valid=None, agg="token_mean", norm_len=None, weights=None, row_valid=None):
        self.index = index.long()
        self.num_elements = num_elements
        self.valid = torch.ones_like(self.index, dtype=torch.bool) if valid is None else valid.bool()
        if (self.index < 0).any() or (self.index >= num_elements).any():
            raise ValueError(f"element indices must lie in [0, {num_elements}), got {self.index.unique().tolist()}")
        b, k = self.index.shape
        self.identity = k == num_elements and torch.equal(self.index, torch.arange(k).expand(b, k))
        """Whether every row trains every element in order (control, text): the dense layout is the batch itself."""
        if self.identity:
            self.mask = self.valid.clone()
        else:
            self.mask = torch.zeros(b, num_elements, dtype=torch.bool).scatter_(1, self.index, self.valid)
        self.weights = aggregation_weights(self.mask, agg, norm_len=norm_len) if weights is None else weights
        self.row_valid = torch.ones(self.index.shape[0], dtype=torch.bool) if row_valid is None else row_valid.bool()
        """`[b]` False for padding rows (they add nothing to the per-row loss)."""

    def columns(self, cols: torch.Tensor) -> ElementLayout:
        """The layout of columns `cols` alone, keeping the whole batch's aggregation weights (`agg` is then `sum`)."""
        return ElementLayout(
            self.index[:, cols],
            self.num_elements,
            self.valid[:, cols],
            "sum",
            None,
            weights=self.weights,
            row_valid=self.row_valid,
        )

    def dense(self, t: torch.Tensor) -> torch.Tensor:
        """`[b, c]` values of the columns -> `[b, K]` (0 elsewhere); differentiable in `t`."""
        if self.identity:
            return t
        index = to_device(self.index, t.device)  # host data: no wait for the device
        return torch.zeros(t.shape[0], self.num_elements, dtype=t.dtype, device=t.device).scatter(1, index, t)


def terms_loss(
    terms: Terms,
    layout: ElementLayout,
    advantages: torch.Tensor | None,
    objective: str | None,
    hparams: dict[str, Any],
    weighted: bool = False,
):
    """`(loss, row_loss, metrics)` of a batch's `terms` placed by `layout`.

    `loss` is the objective's aggregated loss (with `objective` None: the aggregated `Terms.loss`) plus the
    aggregated penalties; with `weighted`, it is the share of the columns in `layout` (built by
    `ElementLayout.columns`), whose per-element losses carry the whole batch's aggregation weights. `row_loss` is the
    mean of `Terms.row_loss` over the batch's rows (0 without one). `metrics` are the core's (`clipfrac`, per-step
    rows, ...), `pg_loss`, `approx_kl`, `penalty` and the masked means of `Terms.logs`.
    """
    device = next(iter(terms.tensors().values())).device
    mask = to_device(layout.mask, device)  # the layout is host data: copies that wait for nothing
    agg_weights = to_device(layout.weights, device)
    weight = layout.dense(terms.weight.float()) if terms.weight is not None else None
    metrics: dict[str, torch.Tensor] = {}
    loss = torch.zeros((), device=device)
    if objective is not None:
        if terms.logp is None or terms.old_logp is None:
            raise ValueError(f"objective {objective!r} needs Terms.logp and Terms.old_logp")
        inputs = {name: layout.dense(v) for name, v in terms.inputs.items()}
        adv = to_device(advantages, device)
        if weighted:
            weight = agg_weights if weight is None else weight * agg_weights
        loss, metrics = compute_policy_loss(
            objective,
            layout.dense(terms.logp),
            layout.dense(terms.old_logp),
            adv,
            mask,
            weights=weight,
            **{**hparams, **inputs},
        )
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
    row_loss = torch.zeros((), device=device)
    if terms.row_loss is not None:
        rows = layout.row_valid.to(device).float()
        row_loss = (terms.row_loss.float() * rows).sum() / rows.sum().clamp_min(1.0)
    fmask = mask.float()
    for name, value in terms.logs.items():
        metrics[name] = (layout.dense(value.detach().float()) * fmask).sum() / fmask.sum().clamp_min(1.0)
    return loss, row_loss, metrics
