"""Flow-DPPO's divergence mask (arXiv:2606.11025) by hand-computed numbers and against the released loss."""

import pytest
import torch

from flowrl.core import compute_policy_loss, gaussian_step_divergence, get_objective


def _loss(logp, old_logp, adv, mask=None, **hparams):
    return compute_policy_loss("flow_dppo", logp, old_logp, adv, mask, **hparams)


def test_registered_with_the_released_threshold_and_gaussian_inputs():
    objective = get_objective("flow_dppo")
    assert objective.hparams == {"delta": 1e-5, "scale_by_std": True}  # UniRL / verl-omni kl_mask_threshold
    assert set(objective.required) == {"std", "mean_diff_sq"} and objective.elementwise
    assert objective.agg == "token_mean"


def test_step_divergence_is_the_gaussian_kl_per_element():
    # two N(mu, s^2 I) kernels over D = 4 elements: KL = sum (dmu)^2 / (2 s^2); mean-reduced: / D
    mu, mu_old, s = torch.tensor([0.3, -0.1, 0.0, 0.2]), torch.zeros(4), 0.5
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mu_old, s), torch.distributions.Normal(mu, s))
    d = gaussian_step_divergence(s, ((mu - mu_old) ** 2).mean())
    assert float(d) == pytest.approx(float(kl.mean()), rel=1e-6) == pytest.approx(0.14 / 4 / 0.5)
    assert float(gaussian_step_divergence(s, torch.tensor(0.2), scale_by_std=False)) == pytest.approx(0.1)


def test_mask_by_hand():
    # s = 0.5, so D = ||dmu||^2 / (2 * 0.25) = 2 ||dmu||^2; delta = 1e-5
    lr = 0.1
    cases = [  # (A, log-ratio, ||dmu||^2, dropped?)
        (1.0, lr, 1e-5, "high"),  # D = 2e-5 >= delta, r > 1, A > 0: moved further up
        (1.0, -lr, 1e-5, None),  # corrective: r < 1 with A > 0 trains
        (-1.0, -lr, 1e-5, "low"),  # D >= delta, r < 1, A < 0: moved further down
        (-1.0, lr, 1e-5, None),  # corrective
        (1.0, lr, 2e-6, None),  # D = 4e-6 < delta: inside the region, any ratio trains
        (2.0, lr, 5e-6, "high"),  # D = 1e-5 exactly: the peers drop at D >= delta
        (-1.0, 0.0, 1e-3, None),  # r = 1: neither direction
    ]
    adv = torch.tensor([[c[0]] for c in cases], dtype=torch.float64)  # [7, 1]
    old = torch.full((7, 1), -2.0, dtype=torch.float64)
    logp = (old + torch.tensor([[c[1]] for c in cases], dtype=torch.float64)).requires_grad_()
    mds = torch.tensor([[c[2]] for c in cases], dtype=torch.float64)
    loss, metrics = _loss(logp, old, adv[:, 0], std=torch.full((7, 1), 0.5, dtype=torch.float64), mean_diff_sq=mds)
    (grad,) = torch.autograd.grad(loss, logp)
    r = torch.exp(logp.detach() - old)
    kept = torch.tensor([[c[3] is None] for c in cases], dtype=torch.float64)
    # token mean over all 7 steps of -A r on the kept ones; d/dlogp = -A r / 7 there, 0 on the dropped
    assert loss.item() == pytest.approx(float((-adv * r * kept).sum() / 7), rel=1e-12)
    torch.testing.assert_close(grad, -adv * r * kept / 7)
    assert float(metrics["clipfrac_high"]) == pytest.approx(2 / 7)
    assert float(metrics["clipfrac_low"]) == pytest.approx(1 / 7)
    assert float(metrics["kl_mask_fraction"]) == pytest.approx(6 / 7)  # every case but D = 4e-6
    assert float(metrics["kl_new_old_max"]) == pytest.approx(2e-3)


def test_at_the_old_weights_the_ratio_is_one_and_nothing_is_masked():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 3, generator=g, dtype=torch.float64)
    logp = old.clone().requires_grad_()
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    loss, metrics = _loss(
        logp,
        old,
        adv,
        std=torch.rand(6, 3, generator=g, dtype=torch.float64) + 0.1,
        mean_diff_sq=torch.zeros(6, 3, dtype=torch.float64),
        delta=1e-12,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["clipfrac"]) == 0.0
    assert float(metrics["kl_new_old_max"]) == 0.0 and float(metrics["kl_mask_fraction"]) == 0.0
    assert loss.item() == pytest.approx(float(-adv.mean()), rel=1e-12)
    torch.testing.assert_close(grad, -adv[:, None].expand(6, 3) / 18)


def _released(new_logp, old_logp, new_means, old_means, adv, sigma_t, threshold):
    """UniRL's `_flowdppo_kl_adv_loss` (and verl-omni's `FlowDPPOLoss`), written out with autograd."""
    ratio = torch.exp(new_logp - old_logp)
    kl = ((new_means - old_means) ** 2 / (2 * sigma_t**2)).flatten(2).mean(-1)  # [B, S]
    high = kl >= threshold
    dropped = (high & (ratio > 1) & (adv > 0)) | (high & (ratio < 1) & (adv < 0))
    return torch.where(~dropped, -adv * ratio, torch.zeros(())).mean()


def test_matches_the_released_loss_in_value_and_gradient():
    g = torch.Generator().manual_seed(1)
    b, steps, d = 16, 3, 8
    old_means = torch.randn(b, steps, d, generator=g, dtype=torch.float64)
    theta = (old_means + 0.004 * torch.randn(b, steps, d, generator=g, dtype=torch.float64)).requires_grad_()
    sigma = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)[None, :, None]  # per-step std, as the kernels'
    x_next = old_means + sigma * torch.randn(b, steps, d, generator=g, dtype=torch.float64)
    logp = torch.distributions.Normal(theta, sigma).log_prob(x_next).mean(-1)  # element-mean, as flowrl's
    old_logp = torch.distributions.Normal(old_means, sigma).log_prob(x_next).mean(-1)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, steps)
    expected = _released(logp, old_logp, theta, old_means, adv, sigma, 1e-5)
    mds = ((theta - old_means) ** 2).mean(-1)
    loss, metrics = _loss(logp, old_logp, adv[:, 0], std=sigma[..., 0].expand(b, steps), mean_diff_sq=mds)
    assert 0 < float(metrics["clipfrac"]) < 1  # both regimes on this batch
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)  # the two losses share the log-probs' graph
    torch.testing.assert_close(grad, torch.autograd.grad(expected, theta)[0])


def test_untrained_steps_do_not_poison_the_loss():
    # a deterministic (std 0) or padded step with NaN inputs: masked, so neither the value nor the gradient sees it
    logp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.1, float("nan")]])
    mask = torch.tensor([[True, False]])
    loss, metrics = _loss(
        logp,
        old,
        torch.tensor([1.0]),
        mask,
        std=torch.tensor([[0.5, 0.0]]),
        mean_diff_sq=torch.tensor([[1.0, float("nan")]]),
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(1, 2))  # step 0 is dropped (D = 2, r > 1, A > 0)
    assert float(metrics["clipfrac_high"]) == 1.0 and float(metrics["kl_new_old_max"]) == 2.0
