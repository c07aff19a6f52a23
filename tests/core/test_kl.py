import pytest
import torch
from torch.distributions import Normal, kl_divergence

from flowrl.core import KL_ESTIMATORS, diag_gaussian_kl, gaussian_mean_kl, kl_estimate, velocity_mse


def test_estimators_by_hand_and_zero_at_equality():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log(ref/theta) = -0.5
    assert kl_estimate("k1", lp, ref).item() == pytest.approx(0.5)
    assert kl_estimate("k2", lp, ref).item() == pytest.approx(0.125)
    assert kl_estimate("k3", lp, ref).item() == pytest.approx(torch.tensor(-0.5).exp().item() - 1 + 0.5)
    x = torch.randn(10)
    for name in KL_ESTIMATORS:
        assert torch.all(kl_estimate(name, x, x) == 0)
    assert torch.all(kl_estimate("k3", x, torch.randn(10)) >= 0)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate("k4", x, x)


def test_k1_and_k3_are_unbiased_monte_carlo():
    p, q = Normal(0.0, 1.0), Normal(0.3, 1.2)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))  # samples of p
    true = kl_divergence(p, q).item()
    for name in ["k1", "k3"]:
        est = kl_estimate(name, p.log_prob(x), q.log_prob(x)).mean().item()
        assert est == pytest.approx(true, rel=0.05), name


def test_gaussian_mean_kl_matches_torch_and_dt_form():
    g = torch.Generator().manual_seed(0)
    mu, mu_ref = torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, 8, generator=g)
    std = torch.tensor([0.2, 0.5, 1.0])
    ref = kl_divergence(Normal(mu, std.view(3, 1, 1)), Normal(mu_ref, std.view(3, 1, 1))).mean(dim=(1, 2))
    torch.testing.assert_close(gaussian_mean_kl(mu, mu_ref, std), ref)
    dt = torch.tensor([0.1, 0.2, 0.3])
    torch.testing.assert_close(gaussian_mean_kl(mu, mu_ref, std, dt=-dt), ref * dt)
    assert torch.all(gaussian_mean_kl(mu, mu, std) == 0)


def test_diag_gaussian_kl_matches_torch():
    mu, std = torch.randn(2, 5), torch.rand(2, 5) + 0.2
    ref = kl_divergence(Normal(mu, std), Normal(0.0, 1.0)).mean(-1)
    torch.testing.assert_close(diag_gaussian_kl(mu, std), ref)
    ref = kl_divergence(Normal(mu, std), Normal(0.5, 2.0)).sum(-1)
    torch.testing.assert_close(diag_gaussian_kl(mu, std, 0.5, 2.0, reduce="sum"), ref)
    assert diag_gaussian_kl(torch.zeros(1, 3), torch.ones(1, 3)).item() == 0


def test_velocity_mse():
    v = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    assert velocity_mse(v, torch.zeros_like(v)).tolist() == pytest.approx([2.5, 0.0])
    assert torch.all(velocity_mse(v, v) == 0)
