"""The image trainers' step loss against direct implementations, and the objective settings that must take effect.

The direct implementations below write each published formula out with torch's autograd (the flow-SDE kernel,
the Gaussian log-density, 1/|dt| weights, GRPO-Guard's RatioNorm with the stored behaviour means, the KL in
Flow-GRPO's code form): the trainer's loss and gradient must match them.
"""

import copy
import math

import pytest
import torch

from flowrl.core import get_objective, list_objectives

from .conftest import (
    assert_grads_close,
    elements,
    make_trainer,
    micro_batch,
    micro_loss,
    tiny_config,
    update_batch,
)


def _perturb(params, seed=0, scale=2e-2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


def _velocity(model, x, t, cond):
    """The digits transformer's velocity (SD3 calling convention), no CFG."""
    return model(
        hidden_states=x, timestep=t, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled"]
    )[0]


def _flow_sde(x, v, s, s_next, a, sigma_max):
    """Flow-GRPO's SDE step (arXiv:2505.05470 eq. 8): mean and std, written out."""
    dt = s_next - s
    denominator = 1 - (sigma_max if s == 1 else s)
    g = a * math.sqrt(s / denominator)
    mean = x + dt * (v + g**2 / (2 * s) * (x + (1 - s) * v))
    return mean, g * math.sqrt(-dt)


def _log_prob(x_next, mean, std):
    """Element-mean Gaussian log-density `[B]`."""
    return torch.distributions.Normal(mean, std).log_prob(x_next.float()).flatten(1).mean(1)


@pytest.mark.parametrize("trainer_name", ["flow_grpo", "grpo_guard"])
def test_step_loss_matches_a_direct_implementation(tiny_world, tmp_path, trainer_name):
    overrides = [
        "sampling.guidance_scale=1.0",
        "steps.selection=all",
        "steps.weighting=inv_dt",
        "kl.beta=0.5",
        "kl.form=gaussian_dt",
        f"objective.clip_eps_low={3e-3 if trainer_name == 'flow_grpo' else 2e-4}",
    ]
    trainer = make_trainer(tiny_world, tiny_config(trainer_name, tmp_path, overrides=overrides))
    reference = copy.deepcopy(trainer.policy.model)  # the KL reference: the weights before any update
    rollout, _, _ = trainer.collector.sample(0)
    batch = rollout.select(torch.arange(8))
    _perturb(trainer.params)
    assert elements(trainer, batch).shape == (8, 4)  # every step
    adv = torch.linspace(-1.5, 1.5, 8)
    loss, metrics = micro_loss(trainer, batch, adv)
    grads = torch.autograd.grad(loss, trainer.params, allow_unused=True)

    sig, a, T = batch.sigmas.tolist(), batch.noise_level, batch.num_steps
    cond = {k: v[batch.prompt_ids] for k, v in batch.cond.items()}
    clip = trainer.algorithm.objective_hparams["clip_eps_low"]
    per_step, kls = [], []
    for t in range(T):
        x, x_next = batch.latents[:, t], batch.latents[:, t + 1]
        times = batch.timesteps[t].expand(8)
        mean, std = _flow_sde(x, _velocity(trainer.policy.model, x, times, cond), sig[t], sig[t + 1], a, sig[1])
        with torch.no_grad():
            ref_mean, _ = _flow_sde(x, _velocity(reference, x, times, cond), sig[t], sig[t + 1], a, sig[1])
        l = _log_prob(x_next, mean, std) - batch.log_probs[:, t]  # noqa: E741
        if trainer_name == "grpo_guard":  # RatioNorm: s (l + ||mu - mu_old||^2 / (2 s^2)), stored behaviour means
            l = std * (l + (mean - batch.means[:, t]).pow(2).flatten(1).mean(1) / (2 * std**2))
        r = l.exp()
        surrogate = torch.maximum(-adv * r, -adv * r.clamp(1 - clip, 1 + clip))
        per_step.append(surrogate / abs(sig[t + 1] - sig[t]))  # 1/|dt| step weights
        # Flow-GRPO's code KL: the exact step KL times |dt|
        kls.append((mean - ref_mean).pow(2).flatten(1).mean(1) / (2 * std**2) * abs(sig[t + 1] - sig[t]))
    expected = torch.stack(per_step).mean() + 0.5 * torch.stack(kls).mean()
    expected_grads = torch.autograd.grad(expected, trainer.params, allow_unused=True)
    assert 0 < metrics["clipfrac"] < 1 and metrics["kl"] > 0
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)  # fp32 log-densities of two codes
    assert_grads_close(grads, expected_grads)


def test_a_chosen_objective_runs_with_its_own_presets(tiny_world, tmp_path):
    # Flow-GRPO's clip range belongs to ppo: objective.name=gspo trains with GSPO's (image-scale) presets
    trainer = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, objective={"name": "gspo"}))
    assert (
        trainer.algorithm.objective_hparams
        == get_objective("gspo").image_hparams
        == {"clip_eps_low": 3e-5, "clip_eps_high": 4e-5}
    )
    user = make_trainer(
        tiny_world, tiny_config("flow_grpo", tmp_path, objective={"name": "dapo", "clip_eps_low": 1e-3})
    )
    assert user.algorithm.objective_hparams == {"clip_eps_low": 1e-3, "clip_eps_high": pytest.approx(1.4e-4)}


def _binding(trainer, rollout, adv, hparams):
    """What fraction of elements the objective's trust region acts on, with these hyper-parameters."""
    algorithm = trainer.algorithm
    mb = micro_batch(trainer, rollout, adv)
    terms = algorithm.terms(mb, mb.index)
    old_objective_hparams = algorithm.objective_hparams
    algorithm.objective_hparams = hparams
    try:
        _, metrics = micro_loss(trainer, rollout, adv)
    finally:
        algorithm.objective_hparams = old_objective_hparams
    if algorithm.objective != "sapo":
        return float(metrics["clipfrac"])
    # SAPO's soft gate: dl/dlog r = -A 4 sigma (1 - sigma) r; it acts where the gate weight falls below 1/2
    hp = {**get_objective("sapo").hparams, **hparams}
    tau = torch.where(adv[:, None] > 0, hp["tau_pos"], hp["tau_neg"])
    gate = torch.sigmoid(tau * ((terms.logp - terms.old_logp).detach().exp() - 1))
    return float((4 * gate * (1 - gate) < 0.5).float().mean())


TEXT_SCALE_NEVER_BINDS = ("ppo", "grpo", "dapo", "dr_grpo", "sapo", "cispo", "spo", "gppo")
"""Objectives whose text defaults are far wider than image ratios move (GSPO's, DPOK's clamp and GRPO-Guard's
defaults are image-scale already)."""


@pytest.mark.parametrize("name", [n for n in list_objectives() if get_objective(n).image_hparams])
def test_image_scale_trust_regions_bind_on_a_digits_batch(tiny_world, tmp_path, name):
    trainer_name = "grpo_guard" if name == "grpo_guard" else "flow_grpo"
    config = tiny_config(trainer_name, tmp_path, objective={"name": name}, steps={"selection": "all"})
    trainer = make_trainer(tiny_world, config)
    objective = get_objective(name)
    assert trainer.algorithm.objective_hparams == objective.image_hparams  # no user setting: image-scale defaults
    rollout, _, _ = trainer.collector.sample(0)
    adv = torch.linspace(-1, 1, len(rollout))
    trainer.scheduler.run(update_batch(rollout, adv), 0)  # one optimizer step (a mini-batch of 16)
    image = _binding(trainer, rollout, adv, dict(objective.image_hparams))
    assert image > 0, name
    if name in TEXT_SCALE_NEVER_BINDS:  # the text-scale defaults leave the same batch unconstrained (the bug)
        text = _binding(trainer, rollout, adv, {})
        assert text == 0, (name, text, image)


def test_cps_final_step_is_deterministic_and_grpo_guard_trains_every_other_step(tiny_world, tmp_path):
    overrides = ["sampling.sampler=cps_gaussian", "sampling.noise_level=0.8", "steps.selection=all"]
    config = tiny_config("grpo_guard", tmp_path, overrides=overrides)
    trainer = make_trainer(tiny_world, config)
    rollout, _, _ = trainer.collector.sample(0)
    assert rollout.sde_mask.tolist() == [True, True, True, False]  # sigma' = 0: std 0, no density
    assert rollout.stds[-1] == 0 and torch.all(rollout.log_probs[:, -1] == 0)
    assert elements(trainer, rollout).tolist() == [[0, 1, 2]] * len(rollout)
    record = trainer.train_epoch(0)
    assert math.isfinite(float(record["loss"])) and "ratio_mean/step_3" not in record
    with pytest.raises(ValueError, match="sampled deterministically"):
        trainer.policy.log_prob(rollout, 3)
    # RatioNorm assumes Gaussian log-probs: CPS's default (Flow-GRPO's MSE form) is refused for grpo_guard
    with pytest.raises(ValueError, match="use sampler cps_gaussian"):
        make_trainer(tiny_world, tiny_config("grpo_guard", tmp_path, overrides=["sampling.sampler=cps"]))
