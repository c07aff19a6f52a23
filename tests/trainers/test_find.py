import math

import pytest
import torch

from flowrl.config import ConfigError
from flowrl.policies.rollout import Collected
from flowrl.runtime import row_generators
from flowrl.trainers import load_config
from flowrl.trainers.image.find import FINDNoisePolicy

from .conftest import brightness, make_trainer, micro_loss, tiny_config, training_rows, update_batch


def find_config(tmp_path, overrides=(), **top):
    """`tiny_config`'s world and sizes for FIND, sampling with the ODE."""
    data = {
        "trainer": "find",
        "sampling": {"num_steps": 4, "guidance_scale": 2.0, "sampler": "ode"},
        "batch": {"mini_batch_size": 8, "micro_batch_size": 8},
        "prompts": {"prompts_per_epoch": 4, "group_size": 4},
        "eval": {"every": 1, "samples_per_prompt": 2, "max_prompts": 4, "metrics": ["digits_gold"]},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "run": {"epochs": 2, "save_every": 1, "samples_every": 1, "log_with": [], "output_dir": str(tmp_path)},
        "noise_hidden": 16,
        "critic": {"hidden": 16},
        **top,
    }
    return load_config(data, list(overrides))


def _weights(module):
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("variant", ["per_prompt", "conditioned"])
@pytest.mark.parametrize("old_policy", ["prior", "previous"])
def test_noise_policy_starts_at_the_prior_with_ratio_exactly_one(tiny_world, tmp_path, variant, old_policy):
    trainer = make_trainer(tiny_world, find_config(tmp_path, [f"noise_policy={variant}", f"old_policy={old_policy}"]))
    rollout, prompts, _ = trainer.collector.sample(0)
    z, condition = rollout.noise.z, rollout.noise.condition
    # at the prior z_T is exactly the noise the base model would have drawn for this epoch
    generators = row_generators((trainer.config.run.seed, 0, 2), range(len(prompts)))  # one per sample
    base_noise = trainer.policy.adapter.initial_latents(len(prompts), 8, 8, generators)
    assert torch.equal(z, base_noise.float())
    log_prob, regulariser = trainer.model(z, condition)
    # hand-computed N(0, I) log-density, averaged over the 64 latent elements
    expected = -(z**2).flatten(1).mean(-1) / 2 - 0.5 * math.log(2 * math.pi)
    assert torch.allclose(log_prob, expected, atol=1e-6)
    assert torch.equal(log_prob, rollout.noise.log_probs) and torch.equal(regulariser, torch.zeros(len(z)))
    adv = torch.linspace(-1, 1, len(z))
    loss, metrics = micro_loss(trainer, rollout, adv)
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1 and metrics["clipfrac"] == 0
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-7)  # -A clamp(1) + 0.01 * 0
    minibatch = torch.randperm(len(z), generator=torch.Generator().manual_seed(0))[:5]  # any rows, any order
    _, metrics = micro_loss(trainer, rollout.select(minibatch), adv[minibatch])
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1


@pytest.mark.parametrize("variant", ["per_prompt", "conditioned"])
def test_previous_policy_ratio_is_one_for_any_minibatch_after_training(tiny_world, tmp_path, variant):
    """Tables are indexed, so exact; the MLP's output may differ in the last bits with the rows it runs with."""
    overrides = [f"noise_policy={variant}", "old_policy=previous", "run.epochs=1"]
    trainer = make_trainer(tiny_world, find_config(tmp_path, overrides))
    before = _weights(trainer.algorithm.noise_policy)
    trainer.train()
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(trainer.algorithm.noise_policy)))  # moved
    rollout, _, _ = trainer.collector.sample(1)
    for rows in (torch.arange(8), torch.tensor([13, 2, 7, 0, 9]), torch.tensor([5])):
        _, metrics = micro_loss(trainer, rollout.select(rows), torch.ones(len(rows)))
        low, high = metrics["ratio_min"].item(), metrics["ratio_max"].item()
        if variant == "per_prompt":
            assert low == high == 1
        else:
            assert abs(low - 1) <= 1e-6 and abs(high - 1) <= 1e-6


def test_regulariser_proxy_and_exact_kl_hand_values():
    # one prompt, two latent elements: mu = (0.5, -1), sigma = (2, 0.5)
    proxy = FINDNoisePolicy((1, 1, 2), num_prompts=1, kl_form="proxy")
    exact = FINDNoisePolicy((1, 1, 2), num_prompts=1, kl_form="exact")
    for policy in (proxy, exact):
        with torch.no_grad():
            policy.mean.copy_(torch.tensor([0.5, -1.0]).reshape(1, 1, 1, 2))
            policy.std.copy_(torch.tensor([2.0, 0.5]).reshape(1, 1, 1, 2))
    z, ids = torch.zeros(1, 1, 1, 2), torch.zeros(1, dtype=torch.long)
    # FIND's released proxy: mean(mu^2 + (sigma - 1)^2) = mean(0.25 + 1, 1 + 0.25) = 1.25
    assert proxy(z, ids)[1].item() == pytest.approx(1.25)
    # exact: mean over elements of log(1/s) + (s^2 + mu^2)/2 - 1/2 = mean(0.93185, 0.81815) = 0.875
    kl = ((-math.log(2) + 4.25 / 2 - 0.5) + (math.log(2) + 1.25 / 2 - 0.5)) / 2
    assert exact(z, ids)[1].item() == pytest.approx(kl, abs=1e-6) and kl == pytest.approx(0.875)
    # log-density of z = 0: mean(-mu^2 / (2 s^2) - log s) - log(2 pi)/2
    logp = (-(0.25 / 8) - math.log(2) + (-(1 / 0.5) + math.log(2))) / 2 - 0.5 * math.log(2 * math.pi)
    assert proxy(z, ids)[0].item() == pytest.approx(logp, abs=1e-6)


def test_calibrated_advantages_and_calibration_targets(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, find_config(tmp_path, ["critic.steps=1", "noise_policy=conditioned"]))
    rollout, _, _ = trainer.collector.sample(0)
    net = trainer.engine.aux_module("calibration")
    with torch.no_grad():  # V = 0.25 everywhere before the calibration step
        net.net[-1].weight.zero_()
        net.net[-1].bias.fill_(0.25)
    rewards = torch.linspace(0, 1, len(rollout))
    condition, text = rollout.noise.condition, rollout.noise.text
    with torch.no_grad():
        mean, std = trainer.algorithm.noise_policy.params(condition)
    collected = Collected(data=rollout, rows=torch.arange(len(rollout)), size=len(rollout))
    batch, stats = trainer.algorithm.prepare(collected, rewards, torch.ones(len(rollout), dtype=torch.bool), 0)
    seen = batch.advantages  # what the update trains on, per sample
    # the calibration step regressed V onto the observed rewards: its loss is mean((0.25 - r)^2)
    assert stats["calibration/loss"] == pytest.approx((0.25 - rewards).pow(2).mean().item(), rel=1e-5)
    # the policy trained on A = lambda_r (r - V), V after the calibration step at the sampling parameters
    with torch.no_grad():
        baseline = net(mean, std, text)
    assert (baseline - 0.25).abs().max() > 0  # the step moved V
    assert torch.allclose(seen, 10.0 * (rewards - baseline), atol=1e-6)


def test_with_the_prior_as_old_policy_a_policy_far_from_it_gets_no_policy_gradient_and_is_warned(
    tiny_world, tmp_path, caplog
):
    # FIND's released code: pi_old = N(0, I). A mean of 1 on every element puts each sample's element-mean log-ratio
    # near KL = 0.5 nats, far past log(1.2) = 0.18: the clamp objective gives every sample zero policy gradient and
    # only the regulariser trains; the epoch logs noise/in_band_frac 0 and warns once
    trainer = make_trainer(tiny_world, find_config(tmp_path, ["noise_policy=per_prompt", "kl.beta=0.01"]))
    policy = trainer.algorithm.noise_policy
    with torch.no_grad():
        policy.mean.fill_(1.0)
    rollout, _, _ = trainer.collector.sample(0)
    collected = Collected(data=rollout, rows=torch.arange(len(rollout)), size=len(rollout))
    with caplog.at_level("WARNING", logger="flowrl.trainers.image.find"):
        batch, stats = trainer.algorithm.prepare(
            collected, torch.linspace(0, 1, len(rollout)), torch.ones(len(rollout), dtype=torch.bool), 0
        )
    assert stats["noise/in_band_frac"] == 0.0
    assert sum("outside the clamp band" in r.message for r in caplog.records) == 1
    loss, metrics = micro_loss(trainer, rollout, batch.advantages)
    assert metrics["clipfrac"] == 1
    (grad,) = torch.autograd.grad(loss, [policy.mean])
    # only the proxy regulariser's gradient is left: d/dmu 0.01 mean(mu^2 + (s - 1)^2) = 0.01 * 2 mu / numel
    numel = policy.mean[0].numel()
    used = torch.zeros_like(policy.mean)
    used[rollout.noise.condition.unique()] = 1
    torch.testing.assert_close(grad, used * 0.01 * 2 * 1.0 / numel * _rows_per_prompt(rollout, policy))


def _rows_per_prompt(rollout, policy):
    """`[P, 1, 1, 1]`-broadcastable: the share of the batch's rows each prompt's table row appears in."""
    counts = torch.bincount(rollout.noise.condition, minlength=policy.mean.shape[0]).float()
    return (counts / len(rollout)).view(-1, *([1] * (policy.mean.ndim - 1)))


def test_sigma_is_clamped_after_every_optimizer_step(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, find_config(tmp_path, ["min_std=0.01"]))
    policy = trainer.algorithm.noise_policy
    for group in trainer.optimizer.param_groups:
        group["lr"] = 10.0  # an adversarial step: sigma 1 -> about -9
    policy.mean.grad = torch.zeros_like(policy.mean)
    policy.std.grad = torch.ones_like(policy.std)
    trainer.engine.step()
    trainer.algorithm.after_step()  # the scheduler calls it after every optimizer step
    assert torch.equal(policy.std, torch.full_like(policy.std, 0.01))
    assert torch.isfinite(policy.log_prob(torch.zeros(1, 1, 8, 8), torch.zeros(1, dtype=torch.long))).all()


@pytest.mark.parametrize("variant", ["per_prompt", "conditioned"])
def test_two_epoch_run_trains_the_noise_policy_and_the_calibration_net_only(tiny_world, tmp_path, variant):
    trainer = make_trainer(tiny_world, find_config(tmp_path, [f"noise_policy={variant}"]))
    algorithm = trainer.algorithm
    noise, calib = _weights(algorithm.noise_policy), _weights(algorithm.calibration)
    model = _weights(trainer.policy.model)
    summary = trainer.train()
    assert all(not torch.equal(a, b) for a, b in zip(noise, _weights(algorithm.noise_policy)))
    assert all(not torch.equal(a, b) for a, b in zip(calib, _weights(algorithm.calibration)))
    assert all(torch.equal(a, b) for a, b in zip(model, _weights(trainer.policy.model))), "the sampler trained"
    lines = training_rows(tmp_path)
    for record in lines:
        for key in (
            "reward/mean",
            "loss",
            "clipfrac",
            "approx_kl",
            "regulariser",
            "calibration/loss",
            "adv/std",
            "noise/kl_to_prior",
            "noise/std_mean",
            "ratio_mean/step_0",
            "grad_norm",
            "eval/digits_gold",
        ):
            assert key in record and math.isfinite(record[key]), key
    assert math.isfinite(summary["gold_end"])


def test_evaluation_at_the_prior_is_the_base_models(tiny_world, tmp_path):
    find = make_trainer(tiny_world, find_config(tmp_path / "find", ["noise_policy=conditioned"]))
    base = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path / "base"))
    assert find.evaluate() == base.evaluate()
    mean_only = make_trainer(tiny_world, find_config(tmp_path / "mean", ["eval_noise=mean"]))
    assert mean_only.evaluate()["eval/diversity"] == 0.0  # z = mu for every sample of a prompt, ODE sampler


def test_the_noise_mean_moves_along_the_advantage_weighted_draws(tiny_world, tmp_path):
    """FIND's policy gradient at the prior (ratio 1, no KL): per prompt, -d/dmu of `-mean_i A_i log N(z_i; mu, 1)`
    is proportional to `sum_i A_i (z_i - mu)`, and Adam's first step moves each element of that prompt's mean by
    `lr` in the sign of its gradient: so by `lr * sign(sum_i A_i z_i)`; prompts without samples do not move.

    (It replaces a check that training on image brightness drifts the mean up, which held only by chance: on
    the tiny model the drift is 1e-4 with either sign, seed by seed.)"""
    overrides = ["kl.beta=0", "batch.mini_batch_size=16", "optim.max_grad_norm=null", "old_policy=prior"]
    trainer = make_trainer(tiny_world, find_config(tmp_path, overrides))
    rollout, _, _ = trainer.collector.sample(0)
    advantages = torch.linspace(-1, 1, len(rollout))
    noise = trainer.algorithm.noise_policy
    before = noise.mean.detach().clone()
    trainer.scheduler.run(update_batch(rollout, advantages), 0)  # one step: a mini-batch of all 16
    moved = noise.mean.detach() - before
    lr = trainer.config.optim.lr
    ids = rollout.noise.condition
    for prompt in ids.unique():
        rows = ids == prompt
        direction = (advantages[rows].view(-1, 1, 1, 1) * rollout.noise.z[rows].float()).sum(0)
        assert torch.equal(torch.sign(moved[prompt]), torch.sign(direction))
        # |step| = lr |g| / (|g| + eps): lr, but for gradients within a few hundred eps of 0
        torch.testing.assert_close(moved[prompt], lr * torch.sign(direction), rtol=2e-2, atol=0.0)
    untouched = torch.ones(len(moved), dtype=torch.bool)
    untouched[ids.unique()] = False
    assert untouched.any() and torch.equal(moved[untouched], torch.zeros_like(moved[untouched]))


def test_resume_is_exact_including_the_calibration_net(tiny_world, tmp_path):
    overrides = ["noise_policy=conditioned", "old_policy=previous"]
    straight = make_trainer(tiny_world, find_config(tmp_path / "a", [*overrides, "run.epochs=4"]))
    straight.train()
    first = make_trainer(tiny_world, find_config(tmp_path / "b", [*overrides, "run.epochs=2"]))
    first.train()
    resumed = make_trainer(tiny_world, find_config(tmp_path / "b", [*overrides, "run.epochs=4"]))
    resumed.train(resume=True)
    for module in ("noise_policy", "calibration"):
        a, b = _weights(getattr(straight.algorithm, module)), _weights(getattr(resumed.algorithm, module))
        assert all(torch.equal(x, y) for x, y in zip(a, b)), module
    history = lambda path: [r["reward/mean"] for r in training_rows(path)]  # noqa: E731
    assert history(tmp_path / "a") == history(tmp_path / "b")


def test_config_checks():
    with pytest.raises(ConfigError, match="lora_rank must be 0"):
        find_config(None, ["model.lora_rank=4"])
    with pytest.raises(ConfigError, match="noise_policy"):
        find_config(None, ["noise_policy=table"])
    with pytest.raises(ConfigError, match="'steps' does not apply to trainer 'find'"):
        find_config(None, ["steps.selection=all"])  # find trains the initial noise: it has no steps section
    with pytest.raises(ConfigError, match="'calibration_lr' was renamed: use critic.lr"):
        find_config(None, ["calibration_lr=1e-3"])
    with pytest.raises(ConfigError, match="kl.form 'gaussian_dt' is not one of find's: proxy, gaussian"):
        find_config(None, ["kl.form=gaussian_dt"])


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_trains_on_tiny_sd3_and_flux_pipelines(family, tmp_path):
    from flowrl.models import tiny_flux, tiny_sd3
    from flowrl.policies import DiffusionPolicy
    from flowrl.trainers import build_trainer

    pipe = (tiny_sd3 if family == "sd3" else tiny_flux)(seed=1)
    policy = DiffusionPolicy.from_pipeline(pipe, forward_batch_size=2, max_sequence_length=16)
    overrides = [
        "sampling.num_steps=2",
        "batch.micro_batch_size=2",
        "batch.mini_batch_size=2",
        "prompts.prompts_per_epoch=2",
        "prompts.group_size=2",
        "eval.max_prompts=1",
        "run.epochs=1",
        "rewards=[{name: brightness}]",
        "eval.metrics=[]",
        "noise_policy=conditioned",
    ]
    config = find_config(tmp_path, overrides)
    trainer = build_trainer(config, policy=policy, reward_fns={"brightness": brightness}, eval_fns={})
    before = _weights(trainer.algorithm.noise_policy)
    record = trainer.train_epoch(0)
    assert math.isfinite(float(record["loss"])) and math.isfinite(record["calibration/loss"])
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(trainer.algorithm.noise_policy)))
