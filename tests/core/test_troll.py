"""TROLL (arXiv:2510.03817, flowrl/core/text/troll.py): hand-computed projections, the plain policy gradient at the old
weights, the implicit gradient through the projection, the support built from the top-k tokens."""

import math

import pytest
import torch

from flowrl.core import compute_policy_loss, get_objective
from flowrl.core.text.troll import project, with_tail
from flowrl.llm.logprobs import support_ids


def troll(p, q, adv=1.0, dtype=torch.float32, **hp):
    """Loss, metrics and d loss / d log p of one token whose support probabilities are `p` (new) and `q` (old)."""
    log_p = torch.tensor([[p]], dtype=dtype).log().requires_grad_(True)  # [1, 1, V]
    log_q = torch.tensor([[q]], dtype=dtype).log()
    loss, metrics = compute_policy_loss(
        "troll",
        log_p[..., 0],
        log_q[..., 0],
        torch.tensor([adv], dtype=dtype),
        topk_logp=log_p,
        old_topk_logp=log_q,
        **hp,
    )
    loss.backward()
    return loss.item(), metrics, log_p.grad[0, 0]


def test_registered_with_its_inputs_and_defaults():
    objective = get_objective("troll")
    assert objective.inputs == ("topk_logp", "old_topk_logp") and objective.agg == "token_mean"
    assert objective.hparams == {"kl_bound": 0.05, "alpha": 1.0, "top_k": 8}
    assert objective.elementwise and not objective.image_hparams


def test_inside_the_trust_region_the_ratio_is_the_plain_one():
    # q = (0.5, 0.5), p = (0.9, 0.1): KL(p || q) = 0.9 ln 1.8 + 0.1 ln 0.2 = 0.529008 - 0.160944 = 0.368064 <= 1
    # -> no projection: l = -A p(a) / q(a) = -1.8, and the regression KL(p || p) = 0
    loss, metrics, _ = troll([0.9, 0.1], [0.5, 0.5], kl_bound=1.0)
    assert loss == pytest.approx(-1.8, abs=1e-5)
    assert float(metrics["troll_kl"]) == pytest.approx(0.368064, abs=1e-5)
    assert float(metrics["troll_projected_frac"]) == 0.0 and float(metrics["troll_regression"]) == pytest.approx(
        0.0, abs=1e-6
    )


def test_outside_the_trust_region_the_projection_is_the_geometric_interpolation():
    # p~ = q^(1 - lam) p^lam / Z = (9^lam, 1) / (9^lam + 1): at lam = 1/2, p~ = (3/4, 1/4), and
    # KL(p~ || q) = 0.75 ln 1.5 + 0.25 ln 0.5 = 0.304099 - 0.173287 = 0.130812: with eps = 0.130812, lam* = 1/2.
    # ratio p~(a) / q(a) = 0.75 / 0.5 = 1.5; regression KL(p~ || p) = 0.75 ln(0.75/0.9) + 0.25 ln(0.25/0.1)
    # = -0.136741 + 0.229073 = 0.092332; l = -1.5 + 0.092332 = -1.407668
    loss, metrics, _ = troll([0.9, 0.1], [0.5, 0.5], kl_bound=0.130812)
    assert loss == pytest.approx(-1.407668, abs=1e-5)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.5, abs=1e-5)
    assert float(metrics["troll_regression"]) == pytest.approx(0.092332, abs=1e-5)
    assert float(metrics["troll_projected_frac"]) == 1.0
    # alpha = 0 leaves the surrogate alone: -A p~(a) / q(a) = -1.5; A = -2 doubles and flips it: 3.0
    assert troll([0.9, 0.1], [0.5, 0.5], kl_bound=0.130812, alpha=0.0)[0] == pytest.approx(-1.5, abs=1e-5)
    assert troll([0.9, 0.1], [0.5, 0.5], adv=-2.0, kl_bound=0.130812, alpha=0.0)[0] == pytest.approx(3.0, abs=1e-5)


def test_projection_meets_the_bound_and_keeps_the_tail_bucket():
    # the support holds 0.8 of p and 0.8 of q: the tail bucket is log(1 - 0.8) under both
    log_p = with_tail(torch.tensor([0.6, 0.2]).log())
    assert log_p.exp().tolist() == pytest.approx([0.6, 0.2, 0.2], abs=1e-6)
    g = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(
        torch.randn(64, 6, generator=g, dtype=torch.float64) * torch.linspace(0, 2, 64)[:, None], -1
    )
    log_q = torch.log_softmax(0.1 * torch.randn(64, 6, generator=g, dtype=torch.float64), -1)
    log_tilde, lam = project(log_p, log_q, 0.05)
    kl_before = (log_p.exp() * (log_p - log_q)).sum(-1)
    kl_after = (log_tilde.exp() * (log_tilde - log_q)).sum(-1)
    outside = kl_before > 0.05
    assert outside.any() and (~outside).any()
    torch.testing.assert_close(kl_after[outside], torch.full_like(kl_after[outside], 0.05), rtol=0, atol=1e-9)
    torch.testing.assert_close(log_tilde[~outside], log_p[~outside])
    assert (lam[~outside] == 1).all() and (lam[outside] < 1).all()


def test_at_the_old_weights_the_gradient_is_the_plain_policy_gradient():
    # p = q: nothing is projected and KL(sg(p~) || p) has gradient sum_i -p_i grad log p_i = 0, so with logits z
    # d l / d z = -A (onehot(a) - p), the softmax policy gradient (token_mean over one token)
    z = torch.tensor([[[1.0, 0.5, -0.3, 0.2]]], dtype=torch.float64, requires_grad=True)  # [1, 1, V]: full vocab
    log_p = torch.log_softmax(z, -1)
    adv = torch.tensor([1.7], dtype=torch.float64)
    loss, metrics = compute_policy_loss(
        "troll", log_p[..., 0], log_p[..., 0].detach(), adv, topk_logp=log_p, old_topk_logp=log_p.detach()
    )
    loss.backward()
    p = log_p.exp().detach()[0, 0]
    expected = -1.7 * (torch.tensor([1.0, 0, 0, 0], dtype=torch.float64) - p)
    torch.testing.assert_close(z.grad[0, 0], expected, rtol=0, atol=1e-10)
    assert float(metrics["ratio_mean"]) == 1.0


def test_gradient_through_the_projection_matches_finite_differences():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    log_q = torch.log_softmax(torch.randn(2, 3, 6, generator=g, dtype=torch.float64), -1)[..., :5]  # tail 1 of 6
    adv = torch.tensor([1.0, -0.7], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])

    def loss_of(logits):
        log_p = torch.log_softmax(torch.cat([logits, torch.zeros(2, 3, 1, dtype=logits.dtype)], -1), -1)[..., :5]
        return compute_policy_loss(
            "troll", log_p[..., 0], log_q[..., 0], adv, mask, topk_logp=log_p, old_topk_logp=log_q, kl_bound=0.02
        )

    leaf = z.clone().requires_grad_(True)
    loss, metrics = loss_of(leaf)
    loss.backward()
    assert 0 < float(metrics["troll_projected_frac"]) <= 1
    numeric = torch.zeros_like(z)
    for i in range(z.numel()):
        step = torch.zeros(z.numel(), dtype=z.dtype)
        step[i] = 1e-6
        step = step.view_as(z)
        numeric.view(-1)[i] = (loss_of(z + step)[0] - loss_of(z - step)[0]) / 2e-6
    torch.testing.assert_close(leaf.grad, numeric, rtol=1e-5, atol=1e-7)
    assert leaf.grad[1, 2].abs().max() == 0  # padding trains nothing


def test_padding_and_missing_inputs():
    log_p = torch.full((1, 2, 3), float("nan"))
    log_p[0, 0] = torch.tensor([0.5, 0.3, 0.1]).log()
    loss, _ = compute_policy_loss(
        "troll",
        log_p[..., 0],
        log_p[..., 0],
        torch.tensor([1.0]),
        torch.tensor([[True, False]]),
        topk_logp=log_p,
        old_topk_logp=log_p,
    )
    assert loss.item() == pytest.approx(-1.0)  # the valid token at the old weights: -A, NaN padding ignored
    with pytest.raises(ValueError, match="needs topk_logp="):
        compute_policy_loss("troll", log_p[..., 0], log_p[..., 0], torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"old_topk_logp must be \[B, K, V\]"):
        compute_policy_loss(
            "troll", log_p[..., 0], log_p[..., 0], torch.tensor([1.0]), topk_logp=log_p, old_topk_logp=log_p[0]
        )
    with pytest.raises(ValueError, match="kl_bound > 0"):
        compute_policy_loss(
            "troll",
            log_p[..., 0],
            log_p[..., 0],
            torch.tensor([1.0]),
            topk_logp=log_p,
            old_topk_logp=log_p,
            kl_bound=0.0,
        )


def test_support_puts_the_sampled_token_first_then_the_top_k_others():
    # vocabulary of 5 with probabilities (0.1, 0.4, 0.05, 0.3, 0.15): ranked 1, 3, 4, 0, 2
    log_softmax = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15]).log().view(1, 1, 5).expand(1, 3, 5)
    tokens = torch.tensor([[3, 2, 1]])  # sampled: a top token, a tail token, the top token
    ids = support_ids(log_softmax, tokens, top_k=2)
    assert ids.tolist() == [[[3, 1, 4], [2, 1, 3], [1, 3, 4]]]
    assert support_ids(log_softmax, tokens, top_k=9).shape == (1, 3, 5)  # capped at the vocabulary
    assert math.isclose(float(log_softmax.gather(-1, ids)[0, 1, 0].exp()), 0.05, rel_tol=1e-6)
