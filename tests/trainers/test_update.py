"""The update on `[b, K]`: every objective and aggregation, whole-K and step by step, on the tiny SD3 policy.

The scheduler hands `compute_policy_loss` a micro-batch's trained steps at once; `batch.backward: per_step` keeps
one step's graph in memory and must give the same loss and gradient, also for objectives that couple the steps
(GSPO's trajectory ratio). The policy is a real (tiny) SD3 pipeline, moved away from the weights that sampled
the rollout so that ratios differ from 1 and trust regions bind.
"""

import math

import pytest
import torch

from flowrl.core import AGGREGATIONS, get_objective, list_objectives
from flowrl.models import tiny_sd3
from flowrl.policies import DiffusionPolicy
from flowrl.run.stats import EpochStats
from flowrl.trainers import build_trainer, load_config

from .conftest import brightness


# trust regions at this policy's scale: the perturbation moves element-mean log-ratios by about 1e-3
HPARAMS = {
    "ppo": {"clip_eps_low": 2e-4, "kwargs": {"dual_clip_c": 1.001}},
    "grpo": {"clip_eps_low": 2e-4},
    "dapo": {"clip_eps_low": 2e-4, "clip_eps_high": 3e-4},
    "dr_grpo": {"clip_eps_low": 2e-4},
    "gspo": {"clip_eps_low": 1e-4, "clip_eps_high": 1e-4},
    "sapo": {"kwargs": {"tau_pos": 3000.0, "tau_neg": 3000.0}},
    "cispo": {"clip_eps_low": 2e-4, "clip_eps_high": 2e-4},
    "spo": {"clip_eps_low": 2e-4},
    "gppo": {"clip_eps_low": 2e-4, "clip_eps_high": 2e-4},
    "clamp": {"clip_eps_low": 2e-4},
    "reinforce": {},
    "grpo_guard": {"clip_eps_low": 2e-5},
}


@pytest.fixture(scope="module")
def policy():
    pipe = tiny_sd3(seed=3)
    pipe.set_progress_bar_config(disable=True)
    return DiffusionPolicy.from_pipeline(pipe, forward_batch_size=4, max_sequence_length=16)


def _trainer(policy, tmp_path, objective, **top):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na blue dog\n")
    data = {
        "trainer": "flow_grpo",
        "sampling": {"num_steps": 3, "guidance_scale": 1.0, "height": 32, "width": 32},
        "batch": {"mini_batch_size": 4, "micro_batch_size": 4},
        "prompts": {"train": str(prompts), "test": str(prompts), "prompts_per_epoch": 2, "group_size": 2},
        "rewards": [{"name": "brightness"}],
        "eval": {"every": 0, "samples_per_prompt": 1},
        "objective": {"name": objective, **HPARAMS.get(objective, {})},
        "steps": {"selection": "random", "k": 2, "weighting": "inv_dt"},
        "kl": {"beta": 0.3, "form": "gaussian"},
        "run": {"epochs": 1, "log_with": [], "output_dir": str(tmp_path / "run")},
        **top,
    }
    return build_trainer(load_config(data), policy=policy, reward_fns={"brightness": brightness}, eval_fns={})


def _perturbed(trainer, seed=0, scale=3e-3, epoch=1):
    """The epoch's update batch at the current weights, then weights moved by `scale` noise (restored by the
    caller)."""
    batch, _, _ = trainer.prepare_epoch(epoch)
    backup = [p.detach().clone() for p in trainer.params]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(scale * torch.randn(p.shape, generator=g))
    return batch, backup


def _run(trainer, batch, agg, per_step, epoch=1):
    """One mini-batch of every row, its gradient accumulated (no step): `(metrics, gradients)`."""
    for p in trainer.params:
        p.grad = None
    algo, scheduler = trainer.algorithm, trainer.scheduler
    algo.agg, algo.objective_hparams = agg, {**algo.objective_hparams, "agg": agg}
    scheduler.config.backward = "per_step" if per_step else "whole"
    stats = EpochStats()
    scheduler.accumulate(scheduler.plan(batch, epoch), torch.arange(batch.size), stats)
    metrics = stats.summary()
    return metrics, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in trainer.params]


@pytest.mark.parametrize(
    "objective", [n for n in list_objectives() if get_objective(n).image_hparams or n == "reinforce"]
)
def test_whole_k_and_per_step_backward_agree_for_every_objective_and_aggregation(policy, tmp_path, objective):
    trainer = _trainer(policy, tmp_path, objective)
    batch, backup = _perturbed(trainer)
    try:
        batch.advantages = torch.tensor([1.5, -0.5, 0.8, -1.2])
        batch.trainable = torch.ones(4, dtype=torch.bool)
        index, _ = trainer.algorithm.elements(batch, 1)  # [4, 2]: two random steps of three per sample
        assert index.shape == (4, 2) and len({tuple(r) for r in index.tolist()}) > 1  # rows train different steps
        for agg in AGGREGATIONS:
            whole, g_whole = _run(trainer, batch, agg, per_step=False)
            step, g_step = _run(trainer, batch, agg, per_step=True)
            assert math.isfinite(whole["loss"]) and whole["penalty"] > 0, (objective, agg)
            # the loss is assembled from the same per-element values: identical, not just close
            assert whole["loss"] == step["loss"], (objective, agg, whole["loss"], step["loss"])
            norm = math.sqrt(sum(float(g.double().square().sum()) for g in g_whole))
            assert norm > 0, (objective, agg)
            for a, b in zip(g_whole, g_step):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * norm)
            if objective not in ("reinforce", "sapo"):  # both regimes occur: the trust region is exercised
                assert 0 < whole["clipfrac"] < 1, (objective, agg, whole["clipfrac"])
            # per-step metrics are per denoising step whatever the selection: a row for each trained step
            trained = sorted(set(index.flatten().tolist()))
            assert sorted(int(k.rsplit("_", 1)[1]) for k in whole if k.startswith("clipfrac/step_")) == trained
    finally:
        with torch.no_grad():
            for p, b in zip(trainer.params, backup):
                p.copy_(b)


def test_gspo_uses_the_trajectory_ratio_hand_checked_on_two_steps(policy, tmp_path):
    trainer = _trainer(
        policy,
        tmp_path,
        "gspo",
        steps={"selection": "all", "weighting": "inv_dt"},
        kl={"beta": 0.0},
        sampling={"num_steps": 2, "guidance_scale": 1.0, "height": 32, "width": 32},
    )
    batch, backup = _perturbed(trainer, seed=1, epoch=0)
    try:
        rollout = batch.data
        index, _ = trainer.algorithm.elements(batch, 0)
        assert index.tolist() == [[0, 1]] * 4
        adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
        batch.advantages, batch.trainable = adv, torch.ones(4, dtype=torch.bool)
        logp = trainer.policy.log_prob(rollout, index)  # [4, 2], with gradient
        l1, l2 = (logp - rollout.log_probs).unbind(-1)
        # by hand: s_i = exp((l1 + l2) / 2), l_i = max(-A s, -A clip(s, 1 - 1e-4, 1 + 1e-4)) at both steps, each
        # step weighted 1/|dt|; the sequence mean over the two steps, then the mean over the rows
        s = torch.exp((l1 + l2) / 2)
        w = 1 / (rollout.sigmas[1:] - rollout.sigmas[:-1]).abs()  # [2]
        expected = (torch.maximum(-adv * s, -adv * s.clamp(1 - 1e-4, 1 + 1e-4)) * w.mean()).mean()
        metrics, grads = _run(trainer, batch, get_objective("gspo").agg, per_step=False, epoch=0)
        assert 0 < metrics["clipfrac"] < 1  # clipped and unclipped rows
        assert metrics["loss"] == pytest.approx(float(expected.detach()), rel=1e-6)
        # the ratio the objective clips is the trajectory's, identical at both steps of a row
        for t in (0, 1):
            assert metrics[f"ratio_mean/step_{t}"] == pytest.approx(float(s.mean()), rel=1e-6)
        expected_grads = torch.autograd.grad(expected, trainer.params, allow_unused=True)
        for g, e in zip(grads, expected_grads):
            # atol: fp32 rounding of gradient elements near 0 (|g| ~ 1e-5) summed in two different orders
            torch.testing.assert_close(g, torch.zeros_like(g) if e is None else e, rtol=1e-4, atol=1e-7)
        # ... while each step's own ratio (what per-step PPO would clip) differs between the steps
        raw = [float(l1.exp().mean()), float(l2.exp().mean())]
        assert [metrics["raw_ratio_mean/step_0"], metrics["raw_ratio_mean/step_1"]] == pytest.approx(raw, rel=1e-6)
        assert abs(raw[0] - metrics["ratio_mean/step_0"]) > 1e-5 or abs(raw[1] - metrics["ratio_mean/step_1"]) > 1e-5
    finally:
        with torch.no_grad():
            for p, b in zip(trainer.params, backup):
                p.copy_(b)


def test_sharding_is_refused_where_the_calls_would_not_stay_in_step(policy, tmp_path):
    # run.shard: fsdp2 makes every forward and backward a collective; settings that break that are refused with
    # one line naming them (the check runs when there are several processes; called directly here)
    trainer = _trainer(policy, tmp_path, "ppo", ema_decay=0.9, optim={"step_grad_norms_every": 1})
    assert not trainer.engine.sharded  # one process: nothing to shard
    trainer.engine.shard = "fsdp2"
    with pytest.raises(ValueError, match="run.shard: fsdp2 is not supported here: optim.step_grad_norms_every") as err:
        trainer.engine.check_shardable([])
    assert "\n" not in str(err.value) and "ema" not in str(err.value)  # FSDP2 and ZeRO-2 keep an EMA
    trainer.engine.shard = "zero3"
    with pytest.raises(ValueError, match="ema_decay keeps an EMA of the parameters, which ZeRO-3 partitions"):
        trainer.engine.check_shardable([])
    trainer.engine.shard = "none"
    (tmp_path / "plain").mkdir()
    _trainer(policy, tmp_path / "plain", "ppo").engine.check_shardable([])  # the shared update: fine
    # ZeRO keeps AdamW's state in its partitions (and checkpoints it): another optimizer is refused by name
    (tmp_path / "rms").mkdir()
    trainer = _trainer(policy, tmp_path / "rms", "ppo", optim={"optimizer": "rmsprop"})
    trainer.engine.check_shardable([])  # FSDP2 is fine with it
    trainer.engine.shard = "zero3"
    with pytest.raises(ValueError, match="run.shard: zero3 is not supported here: ZeRO runs keep AdamW's state"):
        trainer.engine.check_shardable([])
    # an algorithm's own reason joins the list
    with pytest.raises(ValueError, match="the old policy keeps a full copy"):
        trainer.engine.check_shardable(["the old policy keeps a full copy"])


def test_shard_blocks_are_the_outermost_block_lists(policy):
    from flowrl.run.sharding import shard_blocks

    model = policy.model
    units = shard_blocks(model)
    blocks = [m for n, m in model.named_modules() if n.startswith("transformer_blocks.") and n.count(".") == 1]
    assert units and [id(u) for u in units] == [id(b) for b in blocks]
