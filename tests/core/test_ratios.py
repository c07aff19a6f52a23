import math

import pytest
import torch

from flowrl.core import compute_policy_loss, gaussian_log_prob, ratio_norm_grpo_guard, sequence_log_ratio
from flowrl.core.ratios import reduce_elements


def test_gaussian_log_prob_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    x, mu = torch.randn(4, 3, 5, 5, generator=g), torch.randn(4, 3, 5, 5, generator=g)
    std = torch.rand(4, generator=g) + 0.1
    ref = torch.distributions.Normal(mu, std.view(4, 1, 1, 1)).log_prob(x)
    torch.testing.assert_close(gaussian_log_prob(x, mu, std), ref.mean(dim=(1, 2, 3)))
    torch.testing.assert_close(
        gaussian_log_prob(x, mu, std, reduce="sum"), ref.sum(dim=(1, 2, 3)), rtol=1e-5, atol=1e-4
    )
    # mean = sum / D: the 1/D that makes image clip ranges tiny
    d = 3 * 5 * 5
    torch.testing.assert_close(gaussian_log_prob(x, mu, 0.7), gaussian_log_prob(x, mu, 0.7, reduce="sum") / d)
    assert gaussian_log_prob(x.half(), mu.half(), 0.7).dtype == torch.float32
    with pytest.raises(ValueError, match="reduce must be"):
        gaussian_log_prob(x, mu, 0.7, reduce="max")


def _step(seed, n=4096, d=64):
    g = torch.Generator().manual_seed(seed)
    old_mean = torch.randn(1, d, generator=g, dtype=torch.float64).expand(n, d)
    delta = 0.05 * torch.randn(1, d, generator=g, dtype=torch.float64).expand(n, d)  # fixed mu_theta - mu_old
    z = torch.randn(n, d, generator=g, dtype=torch.float64)
    return old_mean, delta, z


def test_ratio_norm_is_exactly_one_without_a_mean_shift():
    old_mean, _, z = _step(0, n=8)
    x_next = old_mean + 0.3 * z
    out = ratio_norm_grpo_guard(x_next, old_mean.clone(), old_mean, 0.3)
    assert torch.all(out == 0) and torch.all(torch.exp(out) == 1)


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_ratio_norm_centres_and_equalises_spread_across_steps(reduce):
    # Monte Carlo over z with a fixed mean shift: the raw log-ratio has mean -b and a spread ~ 1/s;
    # the normalised one has mean 0 and spread ||dmu|| / D (mean) or ||dmu|| (sum) for every s.
    old_mean, delta, z = _step(1)
    d = delta.shape[1]
    target_std = delta[0].norm().item() / (d if reduce == "mean" else 1)
    for s in [0.02, 0.1, 0.5, 2.0]:
        x_next = old_mean + s * z
        raw = gaussian_log_prob(x_next, old_mean + delta, s, reduce=reduce) - gaussian_log_prob(
            x_next, old_mean, s, reduce=reduce
        )
        b = reduce_elements(delta**2, reduce)[0].item() / (2 * s**2)
        assert raw.mean().item() == pytest.approx(-b, abs=4 * raw.std().item() / math.sqrt(len(raw)))
        normed = ratio_norm_grpo_guard(x_next, old_mean + delta, old_mean, s, reduce=reduce)
        assert abs(normed.mean().item()) < 4 * target_std / math.sqrt(len(normed))
        assert normed.std().item() == pytest.approx(target_std, rel=0.05)


def test_ratio_norm_closed_form_and_published_forms_agree():
    old_mean, delta, z = _step(2, n=16)
    s = 0.4
    x_next = old_mean + s * z
    mean = (old_mean + delta).requires_grad_(True)
    normed = ratio_norm_grpo_guard(x_next, mean, old_mean, s)
    # closed form: mean_d z_d * dmu_d with z = (x' - mu_old) / s
    torch.testing.assert_close(normed, (z * delta).mean(-1), rtol=1e-9, atol=1e-12)
    # official code exp((l + mse / (2 s^2)) * s) == Flow-Factory exp(l * s + mse / (2 s))
    log_ratio = gaussian_log_prob(x_next, mean, s) - gaussian_log_prob(x_next, old_mean, s)
    mse = ((mean - old_mean) ** 2).mean(-1)
    torch.testing.assert_close(torch.exp((log_ratio + mse / (2 * s**2)) * s), torch.exp(log_ratio * s + mse / (2 * s)))
    torch.testing.assert_close(torch.exp(normed), torch.exp(log_ratio * s + mse / (2 * s)))
    # gradients flow through the bias term too: d l~ / d mu = z / D
    normed.sum().backward()
    torch.testing.assert_close(mean.grad, z / z.shape[1], rtol=1e-9, atol=1e-12)


def test_grpo_guard_objective_equals_ppo_on_the_normalised_ratio():
    old_mean, delta, z = _step(3, n=8)
    std = torch.tensor([0.1, 0.5] * 4, dtype=torch.float64)
    x_next = old_mean + std[:, None] * z
    mean = (old_mean + 20 * delta).requires_grad_(True)
    logp = gaussian_log_prob(x_next, mean, std).unsqueeze(-1)  # [B, 1]: one step
    old_logp = gaussian_log_prob(x_next, old_mean, std).unsqueeze(-1)
    mean_diff_sq = ((mean - old_mean) ** 2).mean(-1, keepdim=True)
    adv = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    loss, _ = compute_policy_loss(
        "grpo_guard", logp, old_logp, adv, std=std[:, None], mean_diff_sq=mean_diff_sq, clip_eps_low=0.01
    )
    normed = ratio_norm_grpo_guard(x_next, mean, old_mean, std).unsqueeze(-1)
    ref, _ = compute_policy_loss("ppo", normed, torch.zeros_like(normed), adv, clip_eps_low=0.01)
    torch.testing.assert_close(loss, ref)
    g1 = torch.autograd.grad(loss, mean, retain_graph=True)[0]
    g2 = torch.autograd.grad(ref, mean)[0]
    torch.testing.assert_close(g1, g2)


def test_grpo_guard_untrained_deterministic_steps_do_not_poison_gradients():
    # an ODE step outside the SDE window has std 0; masked out, it must not produce 0/0 in the gradient
    lp = torch.zeros(2, 3, requires_grad=True)
    std = torch.tensor([[0.5, 0.5, 0.0]]).expand(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, _ = compute_policy_loss(
        "grpo_guard",
        lp,
        lp.detach() + 0.01,
        torch.ones(2),
        mask,
        std=std,
        mean_diff_sq=torch.zeros(2, 3),
        weights=torch.tensor([1.0, 1.0, float("inf")]),
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


def test_sequence_log_ratio_is_padding_invariant():
    lr = torch.tensor([[0.1, 0.3, 9.0], [0.2, 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = sequence_log_ratio(lr, mask)
    torch.testing.assert_close(out, torch.tensor([[0.2] * 3, [0.2] * 3]))


def test_the_clip_rule_follows_the_spread_of_the_mean_reduced_log_ratio():
    """`clip_for_latent_size` scales a range by sqrt(D_ref / D): the spread of GRPO-Guard's RatioNorm-ed log-ratio
    (and Flow-GRPO's raw one) over samples for the same per-element update shrinks by exactly that factor."""
    from flowrl.core.ratios import clip_for_latent_size, gaussian_log_prob, ratio_norm_grpo_guard

    g = torch.Generator().manual_seed(0)
    s = 0.3
    guard, raw = {}, {}
    for d in (64, 1024):
        old = torch.randn(8000, d, generator=g)
        dmu = 0.01 * torch.randn(1, d, generator=g)
        dmu = dmu / dmu.square().mean().sqrt() * 0.01  # rms(dmu) = 0.01 at both sizes
        x = old + s * torch.randn(8000, d, generator=g)
        guard[d] = ratio_norm_grpo_guard(x, old + dmu, old, s).std().item()
        raw[d] = (gaussian_log_prob(x, old + dmu, s) - gaussian_log_prob(x, old, s)).std().item()
        assert guard[d] == pytest.approx(0.01 / d**0.5, rel=0.03)  # rms(dmu) / sqrt(D)
        assert raw[d] == pytest.approx(guard[d] / s, rel=0.03)  # the raw one: over s
    rule = clip_for_latent_size(2e-6, 64) / clip_for_latent_size(2e-6, 1024)
    assert rule == pytest.approx(4.0)
    assert guard[64] / guard[1024] == pytest.approx(rule, rel=0.05)
    assert raw[64] / raw[1024] == pytest.approx(rule, rel=0.05)
    assert clip_for_latent_size(2e-6, 64) == pytest.approx(6.4e-5)  # the digits world's GRPO-Guard clip
    assert clip_for_latent_size(4e-6, 16 * 64 * 64) == 4e-6  # SD3.5 / FLUX.1 at 512 px: unchanged
    with pytest.raises(ValueError, match="latent sizes must be >= 1"):
        clip_for_latent_size(1e-4, 0)
