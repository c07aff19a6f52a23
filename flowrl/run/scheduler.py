"""The update scheduler: inner epochs x mini-batches x micro-batches over `[B, K]`, the only place batches are cut.

The batch contract (`batch` config section, `docs/distributed.md`): an optimizer step consumes a **mini-batch** of
`batch.mini_batch_size` samples of the whole batch of every process, in an order shuffled the same way on every
process; each process trains the mini-batch's rows it holds (or, for a batch every process holds, such as DPOK's
replay buffer, its contiguous share of the draw), cut into **micro-batches** of at most `batch.micro_batch_size`
rows whose losses are each process's share of the mini-batch's loss: every micro-batch loss is scaled by its share
of the mini-batch's normaliser (elements for `token_mean`, rows for the `seq_mean_*` aggregations, 1 for `sum`),
so the gradients summed over the micro-batches and the processes are the gradient of the mini-batch's loss. The
same config therefore takes the same optimizer steps with the same gradients on 1, 2 or N processes and for any
micro-batch size, up to floating-point reduction order.

A loss that couples rows (an objective reading batch statistics: BAPO's bounds, Clip-Cov's covariance, the 80/20
entropy quantile; an algorithm's pairwise loss) is defined on the whole mini-batch. When some process holds more
than one micro-batch of it, the scheduler first scores every micro-batch without gradient, computes the mini-batch's
loss once on those values (the objective's statistics are then the global mini-batch's: it reduces them over the
processes) and its coefficients `dL/d(terms)`, then re-scores each micro-batch with gradient and back-propagates
`sum(coefficients x terms)`: the exact gradient for the price of one extra forward without gradient. The same
coefficients give the `per_step` backward (one denoising step at a time) for objectives that couple the steps
(GSPO's trajectory ratio). When every process's calls must match (a sharded model, whose forwards and backwards are
collectives; a coupled loss's reductions), every process makes as many calls as the busiest, padding with a fully
masked row that adds nothing.
"""

from __future__ import annotations

import torch

from flowrl.core import get_objective
from flowrl.core.objectives import uses_batch_statistics
from flowrl.core.terms import ElementLayout, Terms, carries_gradient, normaliser, terms_loss
from flowrl.run.ess import ESSScaling
from flowrl.run.grad_probe import GradProbe
from flowrl.run.stats import EpochStats
from flowrl.run.update_batch import MicroBatch, UpdateBatch, _cat_micro, _Own, _Plan
from flowrl.runtime import seeded
from flowrl.sections import BatchConfig


class UpdateScheduler:
    """Runs an epoch's update for an algorithm on the engine; see the module docstring.

    Args:
        config (`BatchConfig`): the batch contract.
        engine (`Engine`): backward passes and steps.
        algorithm (`Algorithm`): elements, terms, advantages of a mini-batch, what follows a step.
        seed (`int`): `run.seed` (the shuffles are drawn from `(seed, epoch, 3, inner epoch)`).
        grad_norms_every (`int`): `optim.step_grad_norms_every`.
    """

    def __init__(self, config: BatchConfig, engine, algorithm, seed: int, grad_norms_every: int = 0):
        self.config, self.engine, self.algorithm, self.seed = config, engine, algorithm, seed
        self.grad_norms_every = grad_norms_every
        self.processes = engine.processes
        spec = get_objective(algorithm.objective) if algorithm.objective else None
        self.spec = spec
        batch_statistics = uses_batch_statistics(spec, algorithm.objective_hparams)
        self.coupled_rows = batch_statistics or algorithm.couples_rows
        """Whether the loss couples the rows of a mini-batch (it is defined on the whole mini-batch)."""
        self.coupled_steps = spec is not None and not spec.elementwise
        """Whether it couples a row's elements (a per-step backward needs the coefficient pass)."""
        self.ess = ESSScaling.of(getattr(algorithm, "config", None), self.processes)
        """VCPO's hook (a config's `ess_scaling` section): each step's lr scaled by its ESS (`flowrl.run.ess`)."""

    # ------------------------------------------------------------------------------------------
    # the plan: which rows each optimizer step trains
    # ------------------------------------------------------------------------------------------

    def mini_batches(self, batch: UpdateBatch, epoch: int):
        """The global rows of each optimizer step, in order (every process draws the same)."""
        if batch.mini_batches is not None:
            yield from batch.mini_batches
            return
        rows = batch.trainable.nonzero().flatten()
        if not len(rows):
            return
        size = self.config.mini_batch_size or len(rows)
        for inner in range(self.config.inner_epochs):
            # the same order on every process (the trailing 0 keeps the stream one process always drew)
            generator = seeded(self.seed, epoch, 3, inner, 0)
            if self.algorithm.updates_groups:
                yield from self._group_mini_batches(batch, rows, size, generator)
                continue
            order = rows[torch.randperm(len(rows), generator=generator)]
            for start in range(0, len(order), size):
                yield order[start : start + size]

    def _group_mini_batches(self, batch: UpdateBatch, rows: torch.Tensor, size: int, generator):
        """Whole groups shuffled as units; each mini-batch holds `size // group size` groups (at least one)."""
        groups = batch.group_ids[rows]
        unique = list(dict.fromkeys(groups.tolist()))
        members = {g: rows[groups == g] for g in unique}
        order = [unique[i] for i in torch.randperm(len(unique), generator=generator).tolist()]
        per_group = max(len(m) for m in members.values())
        take = max(1, size // per_group)
        for start in range(0, len(order), take):
            yield torch.cat([members[g] for g in order[start : start + take]])

    # ------------------------------------------------------------------------------------------
    # the update
    # ------------------------------------------------------------------------------------------

    def run(self, batch: UpdateBatch, epoch: int) -> dict:
        """Every optimizer step of the epoch's update; the pooled diagnostics."""
        plan = self.plan(batch, epoch)
        stats = EpochStats()
        if self.ess is not None:
            self.ess.seq = []  # an early-stopped mini-batch's sequences never reach a step
        self.engine.model.train()
        steps = 0
        for rows in self.mini_batches(batch, epoch):
            approx_kl = self.accumulate(plan, rows, stats)
            if approx_kl is not None:
                stats.add_scalar("early_stop_epoch", 1.0, shared=True)
                break
            if self.ess is None:
                stats.add_scalar("grad_norm", self.engine.step(), shared=True)
            else:  # VCPO: the step at lr * f(ESS of this mini-batch's sequence ratios)
                norm, ess = self.ess.step(self.engine)
                for key, value in {"grad_norm": norm, **ess}.items():
                    stats.add_scalar(key, value, shared=True)
            self.algorithm.after_step()
            steps += 1
        return {**stats.summary(self.processes), "optimizer_steps": steps}

    def plan(self, batch: UpdateBatch, epoch: int) -> _Plan:
        """What every mini-batch of the epoch's update reads: the elements each row trains, where rows live."""
        index, valid = self.algorithm.elements(batch, epoch)  # [B, k] for the rows of `data`
        if valid is None:
            valid = torch.ones(index.shape, dtype=torch.bool)
        lookup = None
        if batch.rows is not None:  # global row -> this process's row of `data` (-1: another process holds it)
            lookup = torch.full((batch.size,), -1, dtype=torch.long)
            lookup[batch.rows] = torch.arange(len(batch.rows))
        every = self.grad_norms_every
        return _Plan(
            batch,
            index,
            valid,
            lookup,
            self.algorithm.num_elements(batch.data),
            probe=bool(every) and epoch % every == 0,
        )

    def accumulate(self, plan: _Plan, rows: torch.Tensor, stats: EpochStats) -> float | None:
        """Forward and backward of this process's share of the mini-batch `rows` (global rows of the batch), its
        gradient accumulated into the parameters (no step) and its diagnostics into `stats`; returns the
        mini-batch's approximate KL when `objective.target_kl` stops the update before this step (else None)."""
        positions, local = self._own(rows, plan.lookup)
        advantages = self.algorithm.mini_batch_advantages(plan.batch.advantages[rows])
        own = _Own(plan.batch, local, rows[positions], advantages[positions], plan.index, plan.valid)
        return self._step(own, plan.num_elements, plan.probe, stats, len(rows))

    def micro_batch(self, batch: UpdateBatch, rows: torch.Tensor | None = None, epoch: int = 0) -> MicroBatch:
        """The rows `rows` of `batch.data` (default: all of them) as one micro-batch, their advantages as the
        update gives them (`mini_batch_advantages` over those rows): what `loss` and an algorithm's `terms` take."""
        index, valid = self.algorithm.elements(batch, epoch)
        valid = torch.ones(index.shape, dtype=torch.bool) if valid is None else valid
        local = torch.arange(len(batch.data)) if rows is None else torch.as_tensor(rows).long()
        global_rows = local if batch.rows is None else batch.rows[local]
        advantages = self.algorithm.mini_batch_advantages(batch.advantages[global_rows])
        return _Own(batch, local, global_rows, advantages, index, valid).micro_batch(torch.arange(len(local)))

    def loss(self, mb: MicroBatch, num_elements: int | None = None) -> tuple[torch.Tensor, dict]:
        """`(loss with its graph, metrics)` of one micro-batch on its own (its loss plus its per-row loss), without
        a backward pass: the loss a test or a debugger inspects."""
        num_elements = num_elements or self.algorithm.num_elements(mb.data)
        loss, row_loss, metrics = terms_loss(
            self._terms(mb),
            self._layout(mb, num_elements),
            mb.advantages,
            self.algorithm.objective,
            self.algorithm.objective_hparams,
        )
        return loss + row_loss, _detached(loss, row_loss, metrics)

    def _own(self, rows: torch.Tensor, lookup: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(positions in rows, rows of data)` of this process's share of a mini-batch's global `rows`."""
        if lookup is None:  # every process holds every row: a contiguous share of the draw each
            world, rank, n = self.processes.world, self.processes.rank, len(rows)
            positions = torch.arange(rank * n // world, (rank + 1) * n // world)
            return positions, rows[positions]
        local = lookup[rows]
        positions = (local >= 0).nonzero().flatten()
        return positions, local[positions]

    def _step(self, own, num_elements, probe_epoch, stats, mini_rows) -> float | None:
        """Forward and backward of this process's share of one mini-batch of `mini_rows` rows; returns the
        mini-batch's approximate KL when `objective.target_kl` stops the update before this step (else None)."""
        size = self.config.micro_batch_size
        lockstep = (self.engine.sharded or self.coupled_rows) and self.processes.world > 1
        # in lockstep every process makes the same calls with the same row counts (a sharded forward is a
        # collective, and so is each chunk of a policy's forward): each pads its share to the busiest's with fully
        # masked rows, which add nothing
        share = int(self.processes.max(len(own))) if lockstep else len(own)
        if self.coupled_rows:
            share = max(share, 1)  # the loss's reductions are collectives: every process calls
        n = len(own)
        chunks = [torch.arange(min(i, n), min(i + size, n)) for i in range(0, share, size)]
        pads = [min(i + size, share) - i - len(c) for i, c in zip(range(0, share, size), chunks)]
        micro = [own.micro_batch(c, pad) for c, pad in zip(chunks, pads)]
        sizes = [(len(c), int(mb.valid.sum()) if len(c) else 0) for c, mb in zip(chunks, micro)]
        agg = self.algorithm.agg
        norms = [normaliser(agg, rows, elements) for rows, elements in sizes]
        total = 1.0 if agg == "sum" else self.processes.sum(sum(norms))
        mode = self.config.backward
        # auto: one step's activations at a time where the loss separates by element and each element is its own
        # network call (denoising steps); a micro-batch whose elements fit in one call keeps the whole backward
        separable = getattr(self.algorithm, "element_calls", False) and not (self.coupled_steps or self.coupled_rows)
        # ZeRO-3 gathers the parameters for each forward and runs each backward one loss late (`ZeroBackward`):
        # a backward per step would interleave the steps' forwards and backwards, which its hooks do not allow
        auto = mode == "auto" and separable and getattr(self.engine, "shard", "none") != "zero3"
        per_step = mode == "per_step" or probe_epoch or auto
        done = []  # (metrics, elements, normaliser) of this mini-batch's calls
        with self.engine.no_sync(), self.engine.autocast():
            if self.coupled_rows and (len(micro) > 1 or per_step) or per_step and self.coupled_steps:
                metrics = self._coupled(micro, sizes, per_step, num_elements, total, mini_rows)
                done.append((metrics, sum(e for _, e in sizes), sum(norms)))
            else:
                probe = GradProbe(self.engine.params) if probe_epoch and not self.coupled_steps else None
                for mb, (rows, elements), norm in zip(micro, sizes, norms):
                    scale = 1.0 if agg == "sum" else norm / max(total, 1e-12)
                    columns = per_step and not (auto and not probe_epoch and len(mb) * mb.index.shape[1] <= size)
                    metrics = self._direct(mb, num_elements, scale, rows / max(mini_rows, 1), columns, probe)
                    done.append((metrics, elements, norm))
        for metrics, elements, norm in done:
            if elements:
                stats.add(metrics, weight=elements, loss_weight=norm)
        target = self.algorithm.target_kl
        if target is None:
            return None
        kl = sum(float(m.get("approx_kl", 0.0)) * e for m, e, _ in done)
        kl, elements = self.processes.sums(kl, sum(e for _, e, _ in done))
        approx_kl = kl / max(elements, 1.0)
        if approx_kl > 1.5 * target:
            self.engine.zero_grad()  # SB3: stop before this mini-batch's step
            return approx_kl
        return None

    # ------------------------------------------------------------------------------------------
    # the losses of one micro-batch
    # ------------------------------------------------------------------------------------------

    def _layout(self, mb: MicroBatch, num_elements: int) -> ElementLayout:
        hp = self.algorithm.objective_hparams
        return ElementLayout(
            mb.index, num_elements, mb.valid, self.algorithm.agg, hp.get("norm_len"), row_valid=mb.row_valid
        )

    def _terms(self, mb: MicroBatch, cols: slice | None = None) -> Terms:
        index = mb.index if cols is None else mb.index[:, cols]
        terms = self.algorithm.terms(mb, index)
        if cols is not None and cols.start:  # the per-row loss joins the first column's backward only
            terms.row_loss = None
        return terms

    def _observe(self, terms: Terms, layout: ElementLayout) -> None:
        """The batch's sequence log-ratios for VCPO's ESS (a no-op without it or without log-probs)."""
        if self.ess is not None and terms.logp is not None and terms.old_logp is not None:
            self.ess.observe(layout.dense(terms.logp), layout.dense(terms.old_logp), layout.mask, layout.row_valid)

    def _direct(self, mb, num_elements, scale, row_scale, per_step, probe) -> dict:
        """The micro-batch's loss, back-propagated at `scale` (its per-row loss at `row_scale`), whole or one
        column at a time (an element-wise loss: each column's share is its own)."""
        algo = self.algorithm
        objective, hp = algo.objective, algo.objective_hparams
        layout = self._layout(mb, num_elements)
        k = mb.index.shape[1]
        if not per_step or k == 1:
            terms = self._terms(mb)
            self._observe(terms, layout)
            loss, row_loss, metrics = terms_loss(terms, layout, mb.advantages, objective, hp)
            self.engine.backward(loss * scale + row_loss * row_scale)
            return _detached(loss, row_loss, metrics)
        parts = []
        norms = torch.full((num_elements,), float("nan"))
        if probe is not None:
            probe.reset()
        for j in range(k):
            terms = self._terms(mb, slice(j, j + 1))
            part, row_loss, column_metrics = terms_loss(
                terms, layout.columns(slice(j, j + 1)), mb.advantages, objective, {**hp, "agg": "sum"}, weighted=True
            )
            self.engine.backward(part * scale + row_loss * row_scale)
            parts.append(terms.detached())
            # the column's graph goes before the next column's forward: a checkpointed block's recomputed activations
            # live on its nodes until the graph is freed (two columns' worth otherwise)
            del terms, part, row_loss, column_metrics
            if probe is not None:
                norm = probe.increment_norm() / max(scale, 1e-12)
                element = mb.index[:, j][layout.valid[:, j]].unique()
                if element.numel() == 1:  # one denoising step in this column: its norm is that step's
                    norms[element] = norm
        self._observe(Terms.cat(parts), layout)
        with torch.no_grad():
            loss, row_loss, metrics = terms_loss(Terms.cat(parts), layout, mb.advantages, objective, hp)
        if probe is not None:
            metrics["grad_norm_per_step"] = norms
        return _detached(loss, row_loss, metrics)

    def _coupled(self, micro, sizes, per_step, num_elements, total, mini_rows) -> dict:
        """A coupled loss: scored without gradient, the loss and its coefficients on the whole share, then one
        backward of `sum(coefficients x terms)` per micro-batch (per column with `per_step`)."""
        algo = self.algorithm
        with torch.no_grad():
            values = Terms.cat([self._terms(mb) for mb in micro], dim=0).tensors()
        names = [n for n, v in values.items() if carries_gradient(n) and v.is_floating_point()]
        leaves = {n: v.detach().requires_grad_(True) for n, v in values.items() if n in names}
        whole = _cat_micro(micro)
        layout = self._layout(whole, num_elements)
        self._observe(Terms.from_tensors(values), layout)
        loss, row_loss, metrics = terms_loss(
            Terms.from_tensors({**values, **leaves}), layout, whole.advantages, algo.objective, algo.objective_hparams
        )
        local = normaliser(algo.agg, *map(sum, zip(*sizes))) if sizes else 0.0
        scale = 1.0 if algo.agg == "sum" else local / max(total, 1e-12)
        rows = int(whole.row_valid.sum())
        objective_value = loss * scale + row_loss * (rows / max(mini_rows, 1))
        grads = torch.autograd.grad(objective_value, [leaves[n] for n in names], allow_unused=True)
        coefs = dict(zip(names, grads))
        start = 0
        for mb in micro:
            b = len(mb)
            columns = [slice(j, j + 1) for j in range(mb.index.shape[1])] if per_step else [None]
            for cols in columns:
                column = self._terms(mb, cols).tensors()
                surrogate = []
                for n in names:
                    coef, value = coefs[n], column.get(n)
                    if coef is None or value is None or not value.requires_grad:
                        continue
                    part = coef[start : start + b]
                    if cols is not None and part.ndim == 2:
                        part = part[:, cols]
                    surrogate.append((part.to(value.device) * value).sum())
                if surrogate:
                    self.engine.backward(torch.stack(surrogate).sum())
                del column, surrogate  # this column's graph, before the next column's forward (see `_direct`)
            start += b
        return _detached(loss, row_loss, metrics)


def _detached(loss, row_loss, metrics) -> dict:
    """The loss (the objective's and the penalties', not the per-row loss: an algorithm logs that through
    `Terms.logs`) and the core's metrics, detached."""
    return {"loss": loss.detach(), **{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}}
