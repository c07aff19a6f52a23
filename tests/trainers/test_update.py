"""The update on `[b, K]`: every objective and aggregation, whole-K and step by step, on the tiny SD3 policy.

The loop hands `compute_policy_loss` a minibatch's trained steps at once; `optim.backward: per_step` keeps one
step's graph in memory and must give the same loss and gradient, also for objectives that couple the steps
(GSPO's trajectory ratio). The policy is a real (tiny) SD3 pipeline, moved away from the weights that sampled
the rollout so that ratios differ from 1 and trust regions bind.
"""

import math

import pytest
import torch

from flowrl.core import AGGREGATIONS, get_objective, list_objectives
from flowrl.models import tiny_sd3
from flowrl.policies import DiffusionPolicy
from flowrl.trainers import build_trainer, load_config
from flowrl.trainers.update import Terms, minibatch_update


def _brightness(images, prompts, **_):
    return images.float().mean(dim=(1, 2, 3))


# trust regions at this policy's scale: the perturbation moves element-mean log-ratios by about 1e-3
HPARAMS = {
    "ppo": {"clip_eps_low": 2e-4, "kwargs": {"dual_clip_c": 1.001}},
    "grpo": {"clip_eps_low": 2e-4},
    "dapo": {"clip_eps_low": 2e-4, "clip_eps_high": 3e-4},
    "dr_grpo": {"clip_eps_low": 2e-4},
    "gspo": {"clip_eps_low": 1e-4, "clip_eps_high": 1e-4},
    "sapo": {"kwargs": {"tau_pos": 3000.0, "tau_neg": 3000.0}},
    "cispo": {"clip_eps_low": 2e-4, "clip_eps_high": 2e-4},
    "spo": {"kwargs": {"eps": 2e-4}},
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
        "sampling": {"num_steps": 3, "guidance_scale": 1.0, "forward_batch_size": 4, "height": 32, "width": 32},
        "prompts": {"train": str(prompts), "test": str(prompts), "prompts_per_epoch": 2, "group_size": 2},
        "rewards": [{"name": "brightness"}],
        "eval": {"every": 0, "samples_per_prompt": 1},
        "objective": {"name": objective, **HPARAMS.get(objective, {})},
        "steps": {"selection": "random", "k": 2, "weighting": "inv_dt"},
        "kl": {"beta": 0.3, "form": "gaussian"},
        "run": {"epochs": 1, "log_with": [], "output_dir": str(tmp_path / "run")},
        **top,
    }
    return build_trainer(load_config(data), policy=policy, reward_fns={"brightness": _brightness}, eval_fns={})


def _perturbed(trainer, seed=0, scale=3e-3):
    """The trainer's rollout at the current weights, then weights moved by `scale` noise (restored by the caller)."""
    rollout, _, _ = trainer.collector.sample(0)
    backup = [p.detach().clone() for p in trainer.params]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(scale * torch.randn(p.shape, generator=g))
    return rollout, backup


def _run(trainer, rollout, index, adv, agg, per_step):
    for p in trainer.params:
        p.grad = None
    hparams = {**trainer.objective_hparams, "agg": agg}
    metrics = minibatch_update(lambda cols: trainer.score(rollout, index[:, cols]), index, rollout.num_steps, adv,
                               objective=trainer.objective, hparams=hparams, per_step=per_step,
                               backward=lambda loss: loss.backward())  # fmt: skip
    return metrics, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in trainer.params]


@pytest.mark.parametrize(
    "objective", [n for n in list_objectives() if get_objective(n).image_hparams or n == "reinforce"]
)
def test_whole_k_and_per_step_backward_agree_for_every_objective_and_aggregation(policy, tmp_path, objective):
    trainer = _trainer(policy, tmp_path, objective)
    rollout, backup = _perturbed(trainer)
    try:
        index = trainer.train_elements(rollout, 1)  # [4, 2]: two random steps of three per sample
        assert index.shape == (4, 2) and len({tuple(r) for r in index.tolist()}) > 1  # rows train different steps
        adv = torch.tensor([1.5, -0.5, 0.8, -1.2])
        for agg in AGGREGATIONS:
            whole, g_whole = _run(trainer, rollout, index, adv, agg, per_step=False)
            step, g_step = _run(trainer, rollout, index, adv, agg, per_step=True)
            assert torch.isfinite(whole["loss"]) and whole["penalty"] > 0, (objective, agg)
            # the loss is assembled from the same per-element values: identical, not just close
            assert torch.equal(whole["loss"], step["loss"]), (objective, agg, whole["loss"], step["loss"])
            norm = math.sqrt(sum(float(g.double().square().sum()) for g in g_whole))
            assert norm > 0, (objective, agg)
            for a, b in zip(g_whole, g_step):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * norm)
            if objective not in ("reinforce", "sapo"):  # both regimes occur: the trust region is exercised
                assert 0 < whole["clipfrac"] < 1, (objective, agg, whole["clipfrac"])
            # per-step metrics are per denoising step whatever the selection: counts match the index
            counts = torch.bincount(index.flatten(), minlength=3).float()
            assert torch.equal(whole["count_per_step"].cpu(), counts)
    finally:
        with torch.no_grad():
            for p, b in zip(trainer.params, backup):
                p.copy_(b)


def test_gspo_uses_the_trajectory_ratio_hand_checked_on_two_steps(policy, tmp_path):
    trainer = _trainer(policy, tmp_path, "gspo", steps={"selection": "all", "weighting": "inv_dt"}, kl={"beta": 0.0},
                       sampling={"num_steps": 2, "guidance_scale": 1.0, "forward_batch_size": 4, "height": 32,
                                 "width": 32})  # fmt: skip
    rollout, backup = _perturbed(trainer, seed=1)
    try:
        index = trainer.train_elements(rollout, 0)
        assert index.tolist() == [[0, 1]] * 4
        adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
        logp = trainer.policy.log_prob(rollout, index)  # [4, 2], with gradient
        l1, l2 = (logp - rollout.log_probs).unbind(-1)
        # by hand: s_i = exp((l1 + l2) / 2), l_i = max(-A s, -A clip(s, 1 - 1e-4, 1 + 1e-4)) at both steps, each
        # step weighted 1/|dt|; the sequence mean over the two steps, then the mean over the rows
        s = torch.exp((l1 + l2) / 2)
        w = 1 / (rollout.sigmas[1:] - rollout.sigmas[:-1]).abs()  # [2]
        expected = (torch.maximum(-adv * s, -adv * s.clamp(1 - 1e-4, 1 + 1e-4)) * w.mean()).mean()
        metrics, grads = _run(trainer, rollout, index, adv, get_objective("gspo").agg, per_step=False)
        assert 0 < metrics["clipfrac"] < 1  # clipped and unclipped rows
        torch.testing.assert_close(metrics["loss"], expected.detach(), rtol=1e-6, atol=0)
        # the ratio the objective clips is the trajectory's, identical at both steps of a row
        torch.testing.assert_close(metrics["ratio_mean_per_step"], s.mean().detach().expand(2), rtol=1e-6, atol=0)
        expected_grads = torch.autograd.grad(expected, trainer.params, allow_unused=True)
        for g, e in zip(grads, expected_grads):
            # atol: fp32 rounding of gradient elements near 0 (|g| ~ 1e-5) summed in two different orders
            torch.testing.assert_close(g, torch.zeros_like(g) if e is None else e, rtol=1e-4, atol=1e-7)
        # ... while each step's own ratio (what per-step PPO would clip) differs between the steps
        raw = torch.stack([l1.exp().mean(), l2.exp().mean()]).detach()
        torch.testing.assert_close(metrics["raw_ratio_mean_per_step"], raw, rtol=1e-6, atol=0)
        assert (raw - metrics["ratio_mean_per_step"]).abs().max() > 1e-5
    finally:
        with torch.no_grad():
            for p, b in zip(trainer.params, backup):
                p.copy_(b)


def _synthetic(seed=0, b=4, k=5):
    """A `[b, k]` policy whose log-probs are a parameter: its gradient is the loss's `dL/dlogp`."""
    g = torch.Generator().manual_seed(seed)
    theta = (0.1 * torch.randn(b, k, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = torch.randn(b, k, generator=g, dtype=torch.float64) - 2.0
    entropy = torch.rand(b, k, generator=g, dtype=torch.float64)

    def score(columns):
        return Terms(logp=old[:, columns] + theta[:, columns], old_logp=old[:, columns],
                     inputs={"entropy": entropy[:, columns]})  # fmt: skip

    return theta, score, torch.arange(k).expand(b, k), torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)[:b]


@pytest.mark.parametrize(("objective", "hparams"), [("dapo", {"top_entropy_quantile": 0.4}), ("high_entropy", {}),
                                                    ("bapo", {}), ("r2vpo", {})])  # fmt: skip
def test_per_step_backward_keeps_batch_statistics_of_the_whole_minibatch(objective, hparams):
    # an entropy quantile or a ratio variance is a statistic of the whole minibatch: one column at a time must
    # not recompute it per column (the per-step pass fixes dL/dlogp from the whole minibatch first)
    spec = get_objective(objective)
    assert spec.batch_statistics or "top_entropy_quantile" in hparams
    grads = []
    for per_step in (False, True):
        theta, score, index, adv = _synthetic()
        state = spec.init_state() if spec.init_state else None
        hp = {**hparams, **({"state": state} if state is not None else {})}
        if state is not None:
            state["lambda"] = 0.5  # an active variance penalty
        metrics = minibatch_update(score, index, 5, adv, objective=objective, hparams=hp, per_step=per_step,
                                   backward=lambda loss: loss.backward())  # fmt: skip
        assert torch.isfinite(metrics["loss"])
        grads.append(theta.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-12)


def test_a_masked_out_row_takes_part_without_gradient():
    # `Trainer.train_padded`: a process holding none of a minibatch calls the objective on a row whose elements are
    # all masked, with weight 0: no gradient, a stateful objective advances once, as on the other processes
    theta, score, index, adv = _synthetic(b=1)
    state = {**get_objective("r2vpo").init_state(), "lambda": 0.5}
    minibatch_update(score, index, 5, adv, objective="r2vpo", hparams={"state": state}, scale=0.0,
                     backward=lambda loss: loss.backward(), valid=torch.zeros(1, 5, dtype=torch.bool))  # fmt: skip
    assert theta.grad is None or torch.equal(theta.grad, torch.zeros_like(theta))
    # no elements, so no variance: one dual step lambda - dual_lr * var_target = 0.5 - 0.1 * 0.01
    assert state["lambda"] == pytest.approx(0.499, abs=1e-12)


def test_sharding_is_refused_where_the_calls_would_not_stay_in_step(policy, tmp_path):
    # run.shard: fsdp2 makes every forward and backward a collective; settings that break that are refused with
    # one line naming them (the check runs when there are several processes; called directly here)
    trainer = _trainer(policy, tmp_path, "ppo", ema_decay=0.9, optim={"step_grad_norms_every": 1})
    assert not trainer.sharded  # one process: nothing to shard
    with pytest.raises(ValueError, match="ema_decay keeps a full copy.*step_grad_norms_every") as err:
        trainer.check_shardable()
    assert "\n" not in str(err.value)
    (tmp_path / "plain").mkdir()
    _trainer(policy, tmp_path / "plain", "ppo").check_shardable()  # the shared update: fine
    # ZeRO keeps AdamW's state in its partitions (and checkpoints it): another optimizer is refused by name
    (tmp_path / "rms").mkdir()
    trainer = _trainer(policy, tmp_path / "rms", "ppo", optim={"optimizer": "rmsprop"})
    trainer.check_shardable()  # FSDP2 is fine with it
    trainer.shard = "zero3"
    with pytest.raises(ValueError, match="run.shard: zero3 is not supported here: ZeRO runs keep AdamW's state"):
        trainer.check_shardable()


def test_shard_blocks_are_the_outermost_block_lists(policy):
    from flowrl.trainers.sharding import shard_blocks

    model = policy.model
    units = shard_blocks(model)
    blocks = [m for n, m in model.named_modules() if n.startswith("transformer_blocks.") and n.count(".") == 1]
    assert units and [id(u) for u in units] == [id(b) for b in blocks]
