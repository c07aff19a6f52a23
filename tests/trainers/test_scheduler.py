"""The update scheduler on a synthetic `[N, K]` policy: the batch contract, hand-checked.

The policy's log-probs are a parameter `theta [N, K]` plus fixed behaviour log-probs, so a gradient of the loss is
its `dL/dlogp` and every claim is exact in float64: a mini-batch's gradient does not depend on how its rows are cut
into micro-batches (every aggregation, element-wise and coupled objectives, batch statistics, per-row losses), nor
on a per-step backward; a padding row adds nothing; groups stay together; the early stop drops the step.
"""

import dataclasses
from contextlib import nullcontext

import pytest
import torch

from flowrl.core import AGGREGATIONS, get_objective
from flowrl.core.terms import Terms
from flowrl.policies.rollout import Record, per_sample
from flowrl.run.scheduler import UpdateBatch, UpdateScheduler, _Own
from flowrl.runtime import Processes
from flowrl.sections import BatchConfig


N, K = 16, 5


@dataclasses.dataclass
class Rows(Record):
    ids: torch.Tensor = per_sample()
    """`[b]` each row's index into the synthetic policy."""
    mask: torch.Tensor = per_sample()
    """`[b, K]` real elements (text-like padding)."""


class Engine:
    """The engine's interface, on the CPU of one process: backward, step (recording each step's gradient)."""

    sharded = False

    def __init__(self, params):
        self.params, self.model, self.processes = params, torch.nn.Module(), Processes.single()
        self.steps: list[torch.Tensor] = []

    def no_sync(self):
        return nullcontext()

    def autocast(self):
        return nullcontext()

    def backward(self, loss):
        loss.backward()

    def step(self):
        grad = self.params[0].grad
        self.steps.append(torch.zeros_like(self.params[0]) if grad is None else grad.clone())
        self.params[0].grad = None
        return float(self.steps[-1].norm())

    def zero_grad(self):
        self.params[0].grad = None


class Synthetic:
    """An algorithm whose log-probs are `old + theta`; `row_weight` adds a per-row loss `w * sum_k theta`."""

    couples_rows = updates_groups = False
    target_kl = None

    def __init__(self, objective="ppo", agg=None, row_weight=0.0, seed=0, **hparams):
        g = torch.Generator().manual_seed(seed)
        self.theta = (0.2 * torch.randn(N, K, generator=g, dtype=torch.float64)).requires_grad_(True)
        self.old = torch.randn(N, K, generator=g, dtype=torch.float64) - 2.0
        self.entropy = torch.rand(N, K, generator=g, dtype=torch.float64)
        self.objective, self.row_weight = objective, row_weight
        self.agg = agg or get_objective(objective).agg
        self.objective_hparams = {"agg": self.agg, **hparams}
        spec = get_objective(objective)
        if spec.init_state is not None:  # a stateful objective's controller, active (R2VPO: a lambda of 0.5)
            state = spec.init_state()
            self.objective_hparams["state"] = {**state, **({"lambda": 0.5} if "lambda" in state else {})}
        self.stepped = 0

    def elements(self, batch, epoch):
        index = torch.arange(K).expand(len(batch.data), K)
        return index, batch.data.mask.gather(1, index)

    def num_elements(self, data):
        return K

    def terms(self, batch, index):
        ids = batch.data.ids
        terms = Terms(
            logp=self.old[ids].gather(1, index) + self.theta[ids].gather(1, index),
            old_logp=self.old[ids].gather(1, index),
            inputs={"entropy": self.entropy[ids].gather(1, index)},
        )
        if self.row_weight:
            terms.row_loss = self.row_weight * self.theta[ids].sum(-1)
        return terms

    def mini_batch_advantages(self, advantages):
        return advantages

    def after_step(self):
        self.stepped += 1


def _batch(padded=True, groups=None):
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(N, K, dtype=torch.bool)
    if padded:  # rows end at different lengths, as completions do
        lengths = torch.randint(1, K + 1, (N,), generator=g)
        mask = torch.arange(K) < lengths[:, None]
    advantages = torch.randn(N, generator=g, dtype=torch.float64)
    group_ids = torch.arange(N) // 4 if groups is None else groups
    return UpdateBatch(
        data=Rows(ids=torch.arange(N), mask=mask),
        rows=torch.arange(N),
        size=N,
        advantages=advantages,
        trainable=torch.ones(N, dtype=torch.bool),
        group_ids=group_ids,
    )


def _steps(algorithm, batch, **config):
    """The gradient of each optimizer step of a run of the scheduler."""
    engine = Engine([algorithm.theta])
    UpdateScheduler(BatchConfig(**config), engine, algorithm, seed=0).run(batch, epoch=0)
    return engine.steps


CASES = [
    ("ppo", {"clip_eps_low": 0.2}),
    ("dapo", {"clip_eps_low": 0.2, "clip_eps_high": 0.28}),
    ("gspo", {}),
    ("sapo", {}),
    ("bapo", {}),
    ("high_entropy", {}),
    ("r2vpo", {}),
    ("clip_cov", {}),
]


@pytest.mark.parametrize(("objective", "hparams"), CASES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_the_micro_batch_size_changes_no_step(objective, hparams, agg):
    # the same mini-batches, the same gradients: micro-batches of 1, 3 or 8 rows against the whole mini-batch
    reference = None
    for micro in (8, 1, 3):
        algorithm = Synthetic(objective, agg=agg, **hparams)
        steps = _steps(algorithm, _batch(), mini_batch_size=8, micro_batch_size=micro, inner_epochs=2)
        assert len(steps) == 4 and algorithm.stepped == 4  # 2 inner epochs x 16 / 8
        if reference is None:
            reference = steps
            assert all(s.abs().sum() > 0 for s in steps)
            continue
        for a, b in zip(steps, reference):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("objective", "hparams"), CASES)
def test_a_per_step_backward_changes_no_step(objective, hparams):
    # one backward per element column, with the mini-batch's statistics fixed first (coupled objectives); the
    # column shares carry the aggregation's weights, which the core keeps in fp32: equal to fp32 rounding
    whole = _steps(Synthetic(objective, **hparams), _batch(), mini_batch_size=16, micro_batch_size=8)
    step = _steps(
        Synthetic(objective, **hparams), _batch(), mini_batch_size=16, micro_batch_size=8, backward="per_step"
    )
    torch.testing.assert_close(step[0], whole[0], rtol=1e-6, atol=1e-9)


def test_a_per_row_loss_is_the_mean_over_the_mini_batch_rows():
    # row_loss w * sum_k theta: its gradient is w / (rows of the mini-batch) on every element of each row
    algorithm = Synthetic("reinforce", row_weight=0.5)
    algorithm.objective = None  # the per-row loss alone
    steps = _steps(algorithm, _batch(padded=False), mini_batch_size=16, micro_batch_size=3)
    torch.testing.assert_close(steps[0], torch.full((N, K), 0.5 / 16, dtype=torch.float64))


def test_a_padding_row_adds_nothing_and_a_stateful_objective_advances_once():
    # a process holding none of a mini-batch calls with one fully masked row (its reductions are collectives)
    algorithm = Synthetic("r2vpo")
    state = {**get_objective("r2vpo").init_state(), "lambda": 0.5}
    algorithm.objective_hparams["state"] = state
    engine = Engine([algorithm.theta])
    scheduler = UpdateScheduler(BatchConfig(), engine, algorithm, seed=0)
    batch = _batch()
    plan = scheduler.plan(batch, 0)
    pad = _Own(batch, torch.arange(0), torch.arange(0), torch.zeros(0), plan.index, plan.valid)
    mb = pad.micro_batch(torch.zeros(0, dtype=torch.long), pad=1)
    assert len(mb) == 1 and not mb.valid.any() and not mb.row_valid.any()
    loss, _ = scheduler.loss(mb)
    loss.backward()
    assert algorithm.theta.grad is None or torch.equal(algorithm.theta.grad, torch.zeros_like(algorithm.theta))
    # no elements, so no variance: one dual step lambda - dual_lr * var_target = 0.5 - 0.1 * 0.01
    assert state["lambda"] == pytest.approx(0.499, abs=1e-12)


def test_padding_rows_beside_real_rows_change_neither_the_loss_nor_its_gradient():
    # in lockstep (sharded models) a process pads its share of a mini-batch to the busiest process's row count
    algorithm = Synthetic("ppo", clip_eps_low=0.2)
    scheduler = UpdateScheduler(BatchConfig(), Engine([algorithm.theta]), algorithm, seed=0)
    batch = _batch()
    plan = scheduler.plan(batch, 0)
    own = _Own(batch, torch.arange(5), torch.arange(5), batch.advantages[:5], plan.index, plan.valid)
    grads, losses = [], []
    for pad in (0, 3):
        algorithm.theta.grad = None
        mb = own.micro_batch(torch.arange(5), pad=pad)
        assert len(mb) == 5 + pad and int(mb.row_valid.sum()) == 5 and not mb.valid[5:].any()
        loss, _ = scheduler.loss(mb)
        loss.backward()
        grads.append(algorithm.theta.grad.clone())
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-12)


def test_groups_stay_together_when_the_algorithm_updates_groups():
    algorithm = Synthetic("ppo", clip_eps_low=0.2)
    algorithm.updates_groups = True
    groups = torch.tensor([0, 1, 2, 3] * 4)  # interleaved: a row-wise cut would split every group
    batch = _batch(groups=groups)
    scheduler = UpdateScheduler(
        BatchConfig(mini_batch_size=8, inner_epochs=3), Engine([algorithm.theta]), algorithm, seed=0
    )
    cuts = list(scheduler.mini_batches(batch, epoch=0))
    assert len(cuts) == 6 and all(len(rows) == 8 for rows in cuts)
    for rows in cuts:
        assert all((groups[rows] == g).sum() == 4 for g in groups[rows].unique())  # whole groups only
    assert len({tuple(sorted(r.tolist())) for r in cuts}) > 2  # shuffled as units each inner epoch


def test_mini_batches_cover_the_trainable_rows_with_the_remainder_last():
    algorithm = Synthetic("ppo")
    batch = _batch()
    batch.trainable[[1, 5, 6]] = False
    scheduler = UpdateScheduler(BatchConfig(mini_batch_size=5), Engine([algorithm.theta]), algorithm, seed=0)
    cuts = list(scheduler.mini_batches(batch, epoch=0))
    assert [len(r) for r in cuts] == [5, 5, 3]
    assert sorted(torch.cat(cuts).tolist()) == batch.trainable.nonzero().flatten().tolist()
    whole = UpdateScheduler(BatchConfig(mini_batch_size=None), Engine([algorithm.theta]), algorithm, seed=0)
    assert [len(r) for r in whole.mini_batches(batch, epoch=0)] == [13]  # None: the whole batch in one step


def test_target_kl_stops_before_the_step_that_exceeds_it():
    algorithm = Synthetic("ppo", clip_eps_low=0.2)
    algorithm.target_kl = 1e-9  # the synthetic policy is far from its behaviour: the first mini-batch exceeds it
    engine = Engine([algorithm.theta])
    stats = UpdateScheduler(BatchConfig(mini_batch_size=8), engine, algorithm, seed=0).run(_batch(), epoch=0)
    assert engine.steps == [] and algorithm.theta.grad is None and stats["early_stop_epoch"] == 1.0


def test_statistics_pool_over_micro_batches_as_over_one():
    # the epoch's diagnostics are per element, however the mini-batch was cut (the core's metrics are fp32)
    rows = []
    for micro in (16, 3):
        algorithm = Synthetic("ppo", clip_eps_low=0.2)
        engine = Engine([algorithm.theta])
        rows.append(
            UpdateScheduler(BatchConfig(mini_batch_size=16, micro_batch_size=micro), engine, algorithm, seed=0).run(
                _batch(), epoch=0
            )
        )
    for key in ("loss", "clipfrac", "approx_kl", "ratio_mean", "ratio_mean/step_0", "clipfrac/step_4"):
        assert rows[1][key] == pytest.approx(rows[0][key], rel=1e-6, abs=1e-9), key


def test_an_algorithm_that_updates_groups_needs_whole_groups_per_process(tiny_world, tmp_path, monkeypatch):
    from flowrl.runtime import Processes
    from flowrl.trainers.image.flow_grpo import FlowGRPO

    from .conftest import make_trainer, tiny_config

    monkeypatch.setattr(FlowGRPO, "updates_groups", True)
    monkeypatch.setattr(Processes, "world", property(lambda self: 3))  # 4 prompts cannot split over 3 processes
    with pytest.raises(ValueError, match=r"updates whole groups.*prompts_per_epoch \(4\) must split over the 3"):
        make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path))
