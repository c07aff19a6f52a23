"""The Flow-DPPO preset (arXiv:2606.11025): Flow-GRPO's loop with the core's `flow_dppo` divergence mask."""

import copy

import pytest
import torch

from flowrl.trainers import load_config

from .conftest import assert_grads_close, make_trainer, micro_loss, tiny_config, train_and_resume
from .test_step_loss import _flow_sde, _log_prob, _perturb, _velocity


# the preset scaled to the tiny world's 4 steps: a random 2-step window in the first 3
TINY = ["sampling.window_size=2", "sampling.window_span=[0, 3]"]


def test_preset_keeps_the_released_settings():
    config = load_config({"trainer": "flow_dppo"})
    assert config.objective.name == "flow_dppo" and config.objective.hparams() == {}  # delta 1e-5, scale_by_std
    s = config.sampling
    assert (s.sampler, s.noise_level, s.guidance_scale, s.num_steps) == ("flow_sde", 0.7, 1.0, 10)
    assert (s.sde_window_schedule, s.window_size, s.window_span) == ("random", 3, (0, 5))
    a = config.advantage
    assert (a.estimator, a.std, a.unbiased, a.eps, a.clip) == ("group", "global", True, 1e-8, None)
    assert config.steps.selection == "all" and config.kl.beta == 0
    with pytest.raises(ValueError, match="flow_dppo trains the flow_dppo objective"):
        load_config({"trainer": "flow_dppo", "objective": {"name": "ppo"}})


def test_ratio_is_one_and_nothing_is_masked_at_the_old_weights(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, tiny_config("flow_dppo", tmp_path, overrides=TINY))
    assert trainer.algorithm.store_means  # the rollouts keep each step's behaviour mean
    rollout, _, _ = trainer.collector.sample(0)
    _, metrics = micro_loss(trainer, rollout, torch.linspace(-1, 1, len(rollout)))
    assert metrics["ratio_mean"] == 1.0 and metrics["ratio_std"] == 0.0
    assert metrics["kl_new_old_max"] == 0.0 and metrics["clipfrac"] == 0.0


def test_step_loss_matches_a_direct_implementation(tiny_world, tmp_path):
    overrides = [
        "sampling.window_size=3",
        "sampling.window_span=[0, 3]",
        "sampling.guidance_scale=1.0",
        "objective.kwargs.delta=2.0e-3",
    ]
    trainer = make_trainer(tiny_world, tiny_config("flow_dppo", tmp_path, overrides=overrides))
    rollout, _, _ = trainer.collector.sample(0)
    batch = rollout.select(torch.arange(8))
    assert batch.sde_steps.tolist() == [0, 1, 2]  # the window [0, 3) of 4 steps; step 3 is an ODE step
    old_model = copy.deepcopy(trainer.policy.model)
    _perturb(trainer.params)
    adv = torch.linspace(-1.5, 1.5, 8)
    loss, metrics = micro_loss(trainer, batch, adv)
    grads = torch.autograd.grad(loss, trainer.params, allow_unused=True)

    sig, a = batch.sigmas.tolist(), batch.noise_level
    cond = {k: v[batch.prompt_ids] for k, v in batch.cond.items()}
    per_step = []
    for t in range(3):
        x, x_next = batch.latents[:, t], batch.latents[:, t + 1]
        times = batch.timesteps[t].expand(8)
        mean, std = _flow_sde(x, _velocity(trainer.policy.model, x, times, cond), sig[t], sig[t + 1], a, sig[1])
        with torch.no_grad():
            old_mean, _ = _flow_sde(x, _velocity(old_model, x, times, cond), sig[t], sig[t + 1], a, sig[1])
        r = (_log_prob(x_next, mean, std) - batch.log_probs[:, t]).exp()
        # the released loss: KL = mean (mu - mu_old)^2 / (2 s^2); drop where KL >= delta moving with A
        kl = ((mean - old_mean) ** 2).flatten(1).mean(1).detach() / (2 * std**2)
        dropped = (kl >= 2e-3) & (((r > 1) & (adv > 0)) | ((r < 1) & (adv < 0)))
        per_step.append(torch.where(dropped, torch.zeros(()), -adv * r))
    expected = torch.stack(per_step).mean()
    expected_grads = torch.autograd.grad(expected, trainer.params, allow_unused=True)
    assert 0 < metrics["clipfrac"] < 1 and 0 < metrics["kl_mask_fraction"] < 1
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    assert_grads_close(grads, expected_grads)


def test_cps_log_probs_are_refused(tiny_world, tmp_path):
    with pytest.raises(ValueError, match="use sampler cps_gaussian"):
        make_trainer(tiny_world, tiny_config("flow_dppo", tmp_path, overrides=[*TINY, "sampling.sampler=cps"]))


def test_two_epochs_train_and_resume_exactly(tiny_world, tmp_path):
    _, _, rows = train_and_resume(tiny_world, tmp_path, "flow_dppo", TINY)
    assert all(0 <= r["clipfrac"] <= 1 and r["kl_new_old_mean"] >= 0 for r in rows)


@pytest.mark.slow
def test_the_shipped_digits_recipe_learns(tmp_path):
    from pathlib import Path

    from flowrl.trainers import build_trainer

    config = Path(__file__).resolve().parents[2] / "configs" / "digits" / "flow_dppo.yaml"
    overrides = [
        "run.epochs=15",
        "eval.every=15",
        "run.log_with=[]",
        f"run.output_dir={tmp_path}",
        "run.save_every=0",
        "run.samples_every=0",
        "run.seed=0",
    ]
    summary = build_trainer(load_config(config, overrides)).train()
    # seed 0 measured 0.607 -> 0.776 at epoch 15 (docs/algorithms/flow_dppo.md)
    assert summary["reward_end"] >= summary["reward_start"] + 0.1
