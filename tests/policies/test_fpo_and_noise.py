import pytest
import torch
from torch.distributions import Normal

from flowrl.core import compute_policy_loss
from flowrl.policies import DiffusionPolicy
from flowrl.policies.flow_mlp import FlowMLPPolicy
from flowrl.policies.fpo import cfm_losses, draw, fpo_log_ratio
from flowrl.policies.noise import InitialNoisePolicy

from ..conftest import TEXT


def _control(seed=0):
    torch.manual_seed(seed)
    policy = FlowMLPPolicy(obs_dim=3, act_dim=2, hidden=32)
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(6, 3, generator=g)
    actions = policy.sample(obs, generator=g)
    return policy, obs, actions, g


@pytest.mark.parametrize("mode", ["mean", "per_draw"])
def test_fpo_ratio_is_exactly_one_at_the_behaviour_parameters(mode):
    policy, obs, actions, g = _control()
    draws = draw(policy.velocity_fn(obs, 8), actions, 8, generator=g)
    assert draws.taus.shape == (6, 8) and draws.noises.shape == (6, 8, 2) and draws.old_losses.shape == (6, 8)
    losses = cfm_losses(policy.velocity_fn(obs, 8), actions, draws.taus, draws.noises)
    log_ratio = fpo_log_ratio(losses, draws.old_losses, mode=mode)
    assert torch.all(log_ratio == 0)
    # fresh draws would not give ratio 1: why the pairs are stored
    fresh = draw(policy.velocity_fn(obs, 8), actions, 8, generator=g)
    assert not torch.all(fpo_log_ratio(fresh.old_losses, draws.old_losses, mode=mode) == 0)


def test_fpo_gradient_at_old_parameters_is_advantage_weighted_flow_matching():
    policy, obs, actions, g = _control(1)
    draws = draw(policy.velocity_fn(obs, 4), actions, 4, generator=g)
    adv = torch.randn(6, generator=g)
    losses = cfm_losses(policy.velocity_fn(obs, 4), actions, draws.taus, draws.noises)  # [B, N]
    log_ratio = fpo_log_ratio(losses, draws.old_losses).unsqueeze(-1)  # [B, 1]
    loss, _ = compute_policy_loss("ppo", log_ratio, torch.zeros_like(log_ratio), adv, clip_eps_low=0.05)
    ours = torch.autograd.grad(loss, list(policy.parameters()))
    # reference: d/dtheta mean_b A_b * mean_i l_theta(b, i)
    ref_loss = (adv * cfm_losses(policy.velocity_fn(obs, 4), actions, draws.taus, draws.noises).mean(-1)).mean()
    ref = torch.autograd.grad(ref_loss, list(policy.parameters()))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_fpo_modes_clamp_and_temperature():
    old = torch.tensor([[1.0, 2.0, 0.5]])
    new = torch.tensor([[0.5, 6.0, 0.5]], requires_grad=True)
    # mean mode: mean(old) - mean(new) = 3.5/3 - 7/3 = -7/6
    assert fpo_log_ratio(new, old).item() == pytest.approx(-7 / 6)
    # per-draw: [0.5, -4 -> clamped to -3, 0]; the clamped draw gets no gradient
    per = fpo_log_ratio(new, old, mode="per_draw")
    assert per.tolist() == [[0.5, -3.0, 0.0]]
    (grad,) = torch.autograd.grad(per.sum(), new)
    assert grad.tolist() == [[-1.0, 0.0, -1.0]]
    # temperature T scales the log-ratio: r_T = r^T
    assert fpo_log_ratio(new, old, temperature=2.0).item() == pytest.approx(-7 / 3)
    # N = 1: both modes coincide
    assert (
        fpo_log_ratio(new[:, :1], old[:, :1]).item() == fpo_log_ratio(new[:, :1], old[:, :1], mode="per_draw").item()
    )
    with pytest.raises(ValueError, match="mode must be"):
        fpo_log_ratio(new, old, mode="max")


def test_fpo_mean_mode_is_not_clamped_and_eps_supervision_weights_the_velocity_error():
    # the authors' mean mode has no clamp: a difference of 30 passes through (compute_policy_loss keeps exp finite)
    assert fpo_log_ratio(torch.zeros(1, 2), torch.full((1, 2), 30.0)).item() == 30.0
    # u_but_supervise_as_eps: the loss on eps^ = x_tau + (1 - tau) v^ is (1 - tau)^2 times the velocity loss
    policy, obs, actions, g = _control(2)
    taus, noises = torch.rand(6, 3, generator=g), torch.randn(6, 3, 2, generator=g)
    velocity = cfm_losses(policy.velocity_fn(obs, 3), actions, taus, noises)
    eps = cfm_losses(policy.velocity_fn(obs, 3), actions, taus, noises, supervise="eps")
    torch.testing.assert_close(eps, (1 - taus) ** 2 * velocity)
    # ... which is the noise regression written out
    x_tau = (1 - taus[..., None]) * actions[:, None] + taus[..., None] * noises
    v = policy.velocity_fn(obs, 3)(x_tau.reshape(18, 2), taus.reshape(18)).reshape(6, 3, 2)
    eps_hat = x_tau + (1 - taus[..., None]) * v
    torch.testing.assert_close(eps, (eps_hat - noises).pow(2).mean(-1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="supervise"):
        cfm_losses(policy.velocity_fn(obs, 3), actions, taus, noises, supervise="x0")


def test_fpo_constant_loss_offset_leaves_the_ratio_unchanged():
    old, new = torch.rand(4, 8), torch.rand(4, 8)
    torch.testing.assert_close(fpo_log_ratio(new + 0.3, old + 0.3), fpo_log_ratio(new, old))


def test_fpo_on_an_image_policy_is_exact_at_the_behaviour_parameters(sd3_pipe):
    policy = DiffusionPolicy.from_pipeline(sd3_pipe, **TEXT, forward_batch_size=2)
    rollout = policy.rollout(
        ["a cat", "a dog", "a cat"],
        num_steps=2,
        sampler="ode",
        generator=torch.Generator().manual_seed(0),
        height=64,
        width=64,
    )
    actions = rollout.latents[:, -1]
    draws = draw(policy.velocity_fn(rollout, 3), actions, 3, generator=torch.Generator().manual_seed(1))
    sub = rollout.select([2])
    losses = cfm_losses(policy.velocity_fn(sub, 3), actions[2:], draws.taus[2:], draws.noises[2:])
    assert torch.equal(losses, draws.old_losses[2:])
    with pytest.raises(ValueError, match="FPO needs a velocity model"):
        from flowrl.models import tiny_unet

        unet = DiffusionPolicy.from_pipeline(tiny_unet())
        unet.velocity_fn(unet.rollout(["a cat"], num_steps=2, height=64, width=64), 2)


@pytest.mark.parametrize("conditioned", [False, True])
def test_initial_noise_policy_log_prob_matches_torch(conditioned):
    shape = (2, 3, 3)
    if conditioned:
        policy = InitialNoisePolicy(shape, embed_dim=5, hidden=16)
        condition = torch.randn(4, 5)
        torch.nn.init.normal_(policy.net[-1].weight, std=0.1)
    else:
        policy = InitialNoisePolicy(shape, num_prompts=3)
        condition = torch.tensor([0, 2, 2, 1])
        with torch.no_grad():
            policy.mean.normal_()
            policy.std.uniform_(0.5, 2.0)
    z = policy.sample(condition, generator=torch.Generator().manual_seed(0))
    mean, std = policy.params(condition)
    ref = Normal(mean, std).log_prob(z).flatten(1).mean(-1)
    torch.testing.assert_close(policy.log_prob(z, condition), ref)
    ref_kl = torch.distributions.kl_divergence(Normal(mean, std), Normal(0.0, 1.0)).flatten(1).mean(-1)
    torch.testing.assert_close(policy.kl_to_prior(condition), ref_kl)


def test_initial_noise_policy_starts_at_the_prior_and_gradients_are_closed_form():
    policy = InitialNoisePolicy((4,), num_prompts=1)
    z = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    ids = torch.tensor([0])
    assert policy.kl_to_prior(ids).item() == 0 and policy.proximity(ids).item() == 0
    prior = InitialNoisePolicy((4,), embed_dim=3)
    assert prior.kl_to_prior(torch.randn(2, 3)).abs().max().item() == 0
    policy.log_prob(z, ids).sum().backward()
    # d/dmu log pi = (z - mu) / sigma^2 / D ; d/dsigma = ((z - mu)^2 / sigma^3 - 1 / sigma) / D
    torch.testing.assert_close(policy.mean.grad[0], z[0] / 4)
    torch.testing.assert_close(policy.std.grad[0], (z[0] ** 2 - 1) / 4)
    # the policy starts at the prior: FIND's ratio against the prior N(0, I) is exactly 1 before any update
    from flowrl.core import gaussian_log_prob

    prior = gaussian_log_prob(z, torch.zeros_like(z), 1.0)
    assert torch.equal(InitialNoisePolicy((4,), num_prompts=1).log_prob(z, ids), prior)
    assert torch.equal(InitialNoisePolicy((4,), embed_dim=3).log_prob(z, torch.randn(1, 3)), prior)


def test_initial_noise_policy_std_floor():
    policy = InitialNoisePolicy((3,), num_prompts=1, min_std=1e-4)
    with torch.no_grad():
        policy.std.fill_(-5.0)  # an adversarial update
    assert policy.params(torch.tensor([0]))[1].min().item() == pytest.approx(1e-4)
    policy.clamp_std_()
    assert policy.std.min().item() == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="exactly one of"):
        InitialNoisePolicy((3,))


def test_initial_noise_feeds_a_rollout(sd3_pipe):
    policy = DiffusionPolicy.from_pipeline(sd3_pipe, **TEXT)
    noise_policy = InitialNoisePolicy((16, 32, 32), num_prompts=2)
    z = noise_policy.sample(torch.tensor([0, 1]), generator=torch.Generator().manual_seed(0))
    rollout = policy.rollout(["a cat", "a dog"], num_steps=2, sampler="ode", latents=z, height=64, width=64)
    assert torch.equal(rollout.latents[:, 0], z)
