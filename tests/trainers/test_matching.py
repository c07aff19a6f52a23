"""The decoupled family on final samples: DiffusionNFT, AWM and image FPO (`flowrl.trainers.shared.matching`)."""

import dataclasses

import pytest
import torch

from flowrl.trainers import load_config
from flowrl.trainers.image.awm import awm_weight
from flowrl.trainers.image.nft import implicit_velocities, nft_loss, optimality
from flowrl.trainers.shared.matching import draw_times

from .conftest import collected, elements, make_trainer, micro_batch, micro_loss, tiny_config, train_and_resume


TINY = {
    "diffusion_nft": ["num_draws=3"],
    "awm": ["num_draws=2"],
    "image_fpo": ["num_draws=3"],
    "tempflow_grpo": ["seeds_per_prompt=1", "branches=2", "prompts.group_size=6", "objective.clip_eps_low=1e-2"],
}


def trainer_for(world, tmp_path, name, overrides=()):
    return make_trainer(world, tiny_config(name, tmp_path, overrides=[*TINY[name], *overrides]))


# ----------------------------------------------------------------------------------------------
# the draws
# ----------------------------------------------------------------------------------------------


def test_grid_draws_are_distinct_grid_levels_and_stratified_draws_one_per_stratum():
    sigmas = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])  # T = 10
    g = torch.Generator().manual_seed(0)
    grid = draw_times("grid", (50, 9), g, sigmas)
    for row in grid:  # NFT: 9 distinct levels of the 10 (1.0 included), never the final 0
        assert len(set(row.tolist())) == 9 and set(row.tolist()) <= set(sigmas[:-1].tolist())
    strat = draw_times("stratified", (200, 6), g, sigmas)
    # AWM's discrete_wo_init on T = 10: strata floor(linspace(1, 9, 7)) = [1, 2, 3, 5, 6, 7, 9] of grid indices
    strata = [(1, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 9)]
    for j, (lo, hi) in enumerate(strata):
        assert set(strat[:, j].tolist()) == {sigmas[i].item() for i in range(lo, hi)}
    assert 0.0 < draw_times("uniform", (4, 2), g).min() and draw_times("logit_normal", (4, 2), g).max() < 1.0


def test_draw_counts_are_checked_against_the_grid():
    with pytest.raises(ValueError, match="num_draws .* must be <= sampling.num_steps"):
        load_config({"trainer": "diffusion_nft", "num_draws": 11})
    with pytest.raises(ValueError, match="strata"):
        load_config({"trainer": "awm", "num_draws": 9})
    with pytest.raises(ValueError, match="'kl' does not apply to trainer 'image_fpo': this trainer has no regul"):
        load_config({"trainer": "image_fpo", "kl": {"beta": 0.1}})  # FPO has no KL term
    with pytest.raises(ValueError, match="'beta' was renamed: use guidance_strength"):
        load_config({"trainer": "diffusion_nft", "beta": 0.1})


# ----------------------------------------------------------------------------------------------
# DiffusionNFT
# ----------------------------------------------------------------------------------------------


def test_nft_implicit_policies_and_optimality():
    v, v_old = torch.randn(5, 3, 4, 4), torch.randn(5, 3, 4, 4)
    for beta in (1.0, 0.1, 0.5):
        pos, neg = implicit_velocities(v, v_old, beta)
        assert torch.allclose(pos + neg, 2 * v_old, atol=1e-6)
        assert torch.allclose(pos, (1 - beta) * v_old + beta * v, atol=1e-6)
    same = implicit_velocities(v_old, v_old, 1.0)
    assert torch.equal(same[0], v_old) and torch.equal(same[1], v_old)
    a = torch.tensor([-7.0, -5.0, -2.5, 0.0, 1.0, 5.0, 9.0])
    assert torch.allclose(optimality(a, 5.0), torch.tensor([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0]))
    # unclipped group advantages sum to zero, so the group mean of 2r - 1 is zero too
    group = torch.tensor([1.2, -0.4, -0.3, -0.5])
    assert abs((2 * optimality(group, 5.0) - 1).mean().item()) < 1e-7


@pytest.mark.parametrize("form", ["x0_adaptive", "velocity"])
@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_gradient_at_the_old_policy_is_the_clipped_advantage_weighted_matching_gradient(form, beta):
    torch.manual_seed(0)
    n, d = 6, 2 * 4 * 4
    x1, eps = torch.randn(n, 2, 4, 4, dtype=torch.float64), torch.randn(n, 2, 4, 4, dtype=torch.float64)
    t = torch.rand(n, dtype=torch.float64)
    x_t = (1 - t[:, None, None, None]) * x1 + t[:, None, None, None] * eps
    v_old = torch.randn(n, 2, 4, 4, dtype=torch.float64)
    adv = torch.tensor([-8.0, -1.0, 0.0, 0.5, 3.0, 6.0], dtype=torch.float64)
    v = v_old.clone().requires_grad_(True)
    value, _ = nft_loss(v, v_old, x1, x_t, eps, t, optimality(adv, 5.0).double(), beta=beta, scale=5.0, form=form)
    (grad,) = torch.autograd.grad(value.sum(), v)
    # by hand: d l / d v at v_old, times clip(A, -5, 5), whatever beta
    tt = t[:, None, None, None]
    if form == "x0_adaptive":
        err = x_t - tt * v_old - x1
        w = err.abs().flatten(1).mean(1).clamp_min(1e-5)[:, None, None, None]
        expected = -2 * tt * err / (d * w)
    else:
        expected = 2 * (v_old - (eps - x1)) / d
    expected = adv.clamp(-5, 5)[:, None, None, None] * expected
    assert torch.allclose(grad, expected, atol=1e-10)
    assert torch.equal(grad[2], torch.zeros_like(grad[2]))  # A = 0: r = 1/2, no gradient
    # the value at theta_old is (Z / beta) l(v_old)
    plain, _ = nft_loss(
        v_old, v_old, x1, x_t, eps, t, torch.full((n,), 0.3, dtype=torch.float64), beta=beta, scale=5.0, form=form
    )
    same, _ = nft_loss(
        v_old, v_old, x1, x_t, eps, t, torch.full((n,), 0.9, dtype=torch.float64), beta=beta, scale=5.0, form=form
    )
    assert torch.allclose(plain, same)


def test_nft_samples_with_the_old_policy_and_decays_it_at_the_steps_taken_after_the_epoch(tiny_world, tmp_path):
    trainer = trainer_for(tiny_world, tmp_path, "diffusion_nft", ["run.epochs=1", "old_decay_rate=0.1"])
    algorithm = trainer.algorithm
    assert algorithm.old_decay() == 0.0
    params = trainer.policy.trainable_parameters()
    with torch.no_grad():  # an old policy that differs from theta: its rollouts are the trainer's
        for shadow in algorithm.old.shadow:
            shadow.mul_(0.5)
    texts = [str(p) for p in trainer.modality.train_prompts[:4]]
    rollout = trainer.collector.sampler(texts, torch.Generator().manual_seed(0), range(4), 0)
    with algorithm.old.swapped():
        expected = trainer.policy.rollout(
            texts, num_steps=4, guidance_scale=2.0, sampler="ode", generator=torch.Generator().manual_seed(0)
        )
    assert torch.equal(rollout.latents, expected.latents)
    before = [p.detach().clone() for p in params]
    old_before = [s.detach().clone() for s in algorithm.old.shadow]
    trainer.train()
    steps = trainer.engine.optimizer_steps
    assert steps >= 1
    # NVlabs reads the step count after the epoch: eta = min(0.1 S, 0.5) already in epoch 1 (not 0, a copy)
    eta = min(0.1 * steps, 0.5)
    assert eta > 0
    for shadow, old, p in zip(algorithm.old.shadow, old_before, params):
        assert torch.allclose(shadow, eta * old + (1 - eta) * p.detach(), atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(before, params))
    assert [algorithm.old_decay(s) for s in (0, 1, 3, 5, 10**6)] == [0.0, 0.1, 0.30000000000000004, 0.5, 0.5]


# ----------------------------------------------------------------------------------------------
# AWM
# ----------------------------------------------------------------------------------------------


def test_awm_weightings_by_hand():
    loss, t = torch.tensor([0.0, 1.0, 16.0, 81.0]), torch.tensor([0.5, 0.5, 0.5, 0.9])
    w = awm_weight(loss, t, "ghuber", 0.25)
    # (t / p) ((l + 1e-10)^p - 1e-10^p): 0 at l = 0; l = 16, t = 0.5: 2 (2 - 0.0031623)
    assert w[0].item() == 0.0 and abs(w[2].item() - 2 * (2 - 1e-10**0.25)) < 1e-5
    assert (w[1:3].diff() > 0).all()  # increasing in l
    assert torch.allclose(awm_weight(loss, t, "ghuber", 1.0), t * loss, atol=1e-6)  # p = 1: the `t` weighting
    assert torch.equal(awm_weight(loss, t, "t2"), t**2 * loss) and torch.equal(awm_weight(loss, t, "uniform"), loss)
    with pytest.raises(ValueError, match="ghuber, uniform, t, t2"):
        awm_weight(loss, t, "huber")


def _prepared(trainer, epoch=0):
    """An epoch's rollout with the trainer's draws and behaviour statistics, as `update` prepares them."""
    rollout, _, _ = trainer.collector.sample(epoch)
    draws = trainer.algorithm.prepare_draws(collected(rollout), torch.linspace(-1, 1, len(rollout)), epoch)
    return dataclasses.replace(rollout, draws=draws)


def test_awm_ratio_is_one_with_the_stored_draws_and_its_gradient_is_advantage_weighted_matching(tiny_world, tmp_path):
    trainer = trainer_for(tiny_world, tmp_path, "awm")
    rollout = _prepared(trainer)
    b = trainer.config.batch.micro_batch_size
    batch = rollout.select(torch.arange(b))
    adv = torch.linspace(-1, 1, b)
    params = [p for p in trainer.policy.model.parameters() if p.requires_grad]
    loss, metrics = micro_loss(trainer, batch, adv)
    # 1 up to float rounding: the stored losses come from a no-grad pass, these from a pass with autograd
    assert abs(metrics["ratio_mean"].item() - 1.0) < 1e-6 and metrics["ratio_std"].item() < 1e-6
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    # at rho = 1 PPO-clip's gradient is that of mean(A^ W(l_theta, t)) over the [b, K] draws
    mb = micro_batch(trainer, batch, adv)
    terms = trainer.algorithm.terms(mb, mb.index)
    expected = torch.autograd.grad((-adv[:, None] * terms.logp).mean(), params, allow_unused=True)
    for g, e in zip(grads, expected):
        assert (g is None and e is None) or torch.allclose(g, e, atol=1e-6, rtol=1e-4)
    # a fresh eps in the training pass (the common bug) moves the ratio off 1 at the same weights
    fresh = dataclasses.replace(
        batch, draws=dataclasses.replace(batch.draws, noises=torch.randn_like(batch.draws.noises))
    )
    _, bad = micro_loss(trainer, fresh, adv)
    assert bad["ratio_std"].item() > 0


def test_awm_kl_ema_pulls_towards_the_lagged_copy_which_decays_after_each_epoch(tiny_world, tmp_path):
    trainer = trainer_for(tiny_world, tmp_path, "awm", ["run.epochs=1", "kl_ema_beta=0.7", "kl_ema_decay_rate=0.05"])
    algorithm = trainer.algorithm
    params = [p for p in trainer.policy.model.parameters() if p.requires_grad]
    assert all(torch.equal(s, p) for s, p in zip(algorithm.kl_ema.shadow, params))  # the copy starts at theta
    with torch.no_grad():  # a copy that differs from theta
        for shadow in algorithm.kl_ema.shadow:
            shadow.mul_(0.9)
    rollout = _prepared(trainer)
    b = trainer.config.batch.micro_batch_size
    batch = rollout.select(torch.arange(b))
    mb = micro_batch(trainer, batch, torch.linspace(-1, 1, b))
    terms = algorithm.terms(mb, mb.index)  # [b, K]
    # by hand: 0.7 mean_d (v_theta - v_ema)^2 at every draw, v_ema the copy's velocity at the same (t, eps)
    data, k = mb.data, mb.index.shape[1]
    for j in range(k):
        x1 = data.latents[:, -1].float()
        taus, noises = data.draws.taus[:, j], data.draws.noises[:, j]
        x_t = x1 + taus.view(-1, 1, 1, 1) * (noises - x1)  # the flow path x_t = (1 - t) x1 + t eps
        with torch.no_grad():
            v = algorithm.velocity(data, x_t, taus)
            with algorithm.kl_ema.swapped():
                v_ema = algorithm.velocity(data, x_t, taus)
        expected = 0.7 * ((v.float() - v_ema.float()) ** 2).mean(dim=(1, 2, 3))
        assert torch.allclose(terms.penalty[:, j].detach(), expected, rtol=1e-4, atol=1e-7)
    assert terms.penalty.detach().abs().sum() > 0
    # after the epoch's S steps: copy <- d copy + (1 - d) theta, d = min(0.05 S, 0.3) read after the steps
    before = [s.clone() for s in algorithm.kl_ema.shadow]
    trainer.train()
    d = min(0.05 * trainer.engine.optimizer_steps, 0.3)
    assert d > 0
    for shadow, old, p in zip(algorithm.kl_ema.shadow, before, params):
        assert torch.allclose(shadow, d * old + (1 - d) * p.detach(), atol=1e-6)


def test_awm_kl_ema_off_keeps_no_copy(tiny_world, tmp_path):
    trainer = trainer_for(tiny_world, tmp_path, "awm", ["kl_ema_beta=0"])
    assert trainer.algorithm.kl_ema is None and _prepared(trainer).draws.old_velocity is None


def test_awm_scales_clipped_advantages_to_advantage_max(tiny_world, tmp_path):
    trainer = trainer_for(tiny_world, tmp_path, "awm", ["advantage.std=none", "advantage.clip=2.0"])
    rewards = {"digits_alignment": torch.tensor([0.0, 1.0, 4.0, 10.0])}
    valid = torch.ones(4, dtype=torch.bool)
    epoch = collected(torch.zeros(4))
    epoch.prompts, epoch.rewards, epoch.group_ids = ["a"] * 4, rewards, torch.zeros(4, dtype=torch.long)
    adv, _ = trainer.algorithm.advantages(epoch, valid)  # the algorithm's hook: AWM rescales the estimator's
    assert torch.allclose(adv, torch.tensor([-2.0, -2.0, 0.25, 2.0]) / 2.0)  # clip(r - 3.75, -2, 2) / 2


# ----------------------------------------------------------------------------------------------
# image FPO
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", ["mean", "per_draw"])
def test_image_fpo_ratio_is_exactly_one_before_an_update(tiny_world, tmp_path, ratio):
    trainer = trainer_for(tiny_world, tmp_path, "image_fpo", [f"ratio={ratio}"])
    rollout = _prepared(trainer)
    b = trainer.config.batch.micro_batch_size
    batch = rollout.select(torch.arange(b))
    assert elements(trainer, batch).shape == (b, 1 if ratio == "mean" else 3)
    adv = torch.linspace(-1, 1, b)
    loss, metrics = micro_loss(trainer, batch, adv)
    assert metrics["ratio_mean"].item() == 1.0 and metrics["ratio_std"].item() == 0.0
    params = [p for p in trainer.policy.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    # at r = 1: the advantage-weighted flow-matching gradient A grad mean_i l_theta_i
    losses = trainer.algorithm.losses(batch)  # [b, N]
    target = (adv[:, None] * losses).mean() if ratio == "per_draw" else (adv * losses.mean(-1)).mean()
    for g, e in zip(grads, torch.autograd.grad(target, params, allow_unused=True)):
        assert (g is None and e is None) or torch.allclose(g, e, atol=1e-6, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# every new image trainer: two epochs and an exact resume
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TINY))
def test_two_epochs_train_and_resume_exactly(tiny_world, tmp_path, name):
    straight, resumed, rows = train_and_resume(tiny_world, tmp_path, name, TINY[name])
    assert all(r["grad_norm"] > 0 for r in rows)
    if name == "diffusion_nft":
        assert all(torch.equal(s, t) for s, t in zip(straight.algorithm.old.shadow, resumed.algorithm.old.shadow))
