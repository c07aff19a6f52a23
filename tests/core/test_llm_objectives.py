"""The text-literature objectives (`flowrl.core.text`: clipping, sequence, reinforce, entropy): hand-computed values
from the papers and the reference notes, and value/gradient parity with direct autograd implementations of the
published formulas."""

import math

import pytest
import torch

from flowrl.core import compute_policy_loss, get_objective
from flowrl.core.text.entropy import entropy_groups


def grad_of(name, logp, old, adv, mask=None, **kw):
    """Loss of `name` and its gradient with respect to `logp`."""
    logp = logp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(name, logp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def tokens(ratios, adv, dtype=torch.float64):
    """One row per token: logp, old_logp with the given ratios (old prob 0.5), advantages `[N]`."""
    r = torch.tensor(ratios, dtype=dtype)
    old = torch.full_like(r, math.log(0.5))[:, None]
    return old + r.log()[:, None], old, torch.tensor(adv, dtype=dtype)


def coef(name, ratios, adv, **kw):
    """Per-token loss value and gradient `dl/dlogp` with `sum` aggregation (one token per row)."""
    logp, old, a = tokens(ratios, adv)
    values = []
    for i in range(len(ratios)):
        loss, grad, _ = grad_of(name, logp[i : i + 1], old[i : i + 1], a[i : i + 1], agg="sum", **kw)
        values.append((float(loss), float(grad)))
    return values


def random_batch(seed=0, b=6, k=9, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, k, generator=g, dtype=dtype) * 3 - 0.05  # log-probs in (-3.05, -0.05)
    logp = (old + 0.4 * torch.randn(b, k, generator=g, dtype=dtype)).clamp_max(-1e-3)
    adv = torch.randn(b, generator=g, dtype=dtype)
    mask = torch.ones(b, k, dtype=torch.bool)
    for i in range(b):
        mask[i, k - i // 2 :] = False  # ragged lengths
    entropy = torch.rand(b, k, generator=g, dtype=dtype) * 2
    return logp, old, adv, mask, entropy


def assert_parity(name, reference, seed=0, **kw):
    """Value and gradient of `compute_policy_loss(name)` equal `reference(logp, old, adv, mask, **inputs)`."""
    logp, old, adv, mask, entropy = random_batch(seed)
    inputs = {k: v for k, v in {"entropy": entropy}.items() if k in get_objective(name).inputs}
    loss, grad, _ = grad_of(name, logp, old, adv, mask, **inputs, **kw)
    x = logp.clone().requires_grad_(True)
    ref = reference(x, old, adv, mask, entropy)
    (ref_grad,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0


def token_mean(per_token, mask):
    return (per_token * mask).sum() / mask.sum()


def ppo_terms(r, a, low, high):
    return torch.maximum(-a * r, -a * torch.minimum(torch.maximum(r, low), high))


# ----------------------------------------------------------------------------------------------
# hand-computed values (reference/algorithms-llm.md tables; the papers' examples)
# ----------------------------------------------------------------------------------------------


def test_bapo_bound_search_matches_the_worked_example():
    # the note's example with 0.72 for its 0.7 (a ratio exactly on a grid bound is a float-rounding coin toss):
    # P = 1.0, N = 1.72 at c_low 0.6, 0.65 and 0.70; 0.75 drops the 0.72 token, N = 1.0: stop at (0.75, 1.2)
    logp, old, adv = tokens([1.0, 1.5, 0.5, 0.72, 1.0], [1.0, 1.0, -1.0, -1.0, -1.0])
    _, _, metrics = grad_of("bapo", logp.T, old.T, adv[None, :].expand(1, 5).clone())
    assert float(metrics["bapo_clip_low"]) == pytest.approx(0.75)
    assert float(metrics["bapo_clip_high"]) == pytest.approx(1.2)
    assert float(metrics["bapo_pos_frac"]) == pytest.approx(0.5)


def test_bapo_code_measure_is_the_authors_plugin():
    # reference/algorithms-llm.md 1.5 with 0.72 for 0.7 (no tie at a bound): (r, A) = (1.0, +1), (1.5, +1),
    # (0.5, -1), (0.72, -1), (1.0, -1). The plugin counts clamped ratios: P = min(1, c_high) + min(1.5, c_high) = 2.2
    # at 1.2; N = max(.5, c_low) + max(.72, c_low) + 1 = 2.32 at 0.6 and grows with c_low: with target P/N >= 1,
    # c_low runs to 0.9 (N = 2.8) and c_high to its max 3.0 (P = 2.5 < 2.8); the paper's measure stops at
    # (0.75, 1.2) (P = 1.0 >= N = 1.0)
    logp, old, adv = tokens([1.0, 1.5, 0.5, 0.72, 1.0], [1.0, 1.0, -1.0, -1.0, -1.0])
    _, _, code = grad_of("bapo", logp.T, old.T, adv[None, :].clone(), measure="code", rho0=1.0)
    assert (float(code["bapo_clip_low"]), float(code["bapo_clip_high"])) == pytest.approx((0.9, 3.0))
    _, _, paper = grad_of("bapo", logp.T, old.T, adv[None, :].clone(), rho0=0.5)
    assert (float(paper["bapo_clip_low"]), float(paper["bapo_clip_high"])) == pytest.approx((0.75, 1.2))
    # the plugin's example target 0.5 (P/N): met at once, P = 2.2 >= 0.5 * 2.32
    _, _, example = grad_of("bapo", logp.T, old.T, adv[None, :].clone(), measure="code", rho0=0.5)
    assert (float(example["bapo_clip_low"]), float(example["bapo_clip_high"])) == pytest.approx((0.6, 1.2))
    with pytest.raises(ValueError, match="measure"):
        grad_of("bapo", logp.T, old.T, adv[None, :].clone(), measure="plugin")


def test_bapo_raises_the_upper_bound_when_the_lower_one_is_exhausted():
    # negatives dominate at every c_low up to 0.9: c_high rises until the 2.5-ratio positive counts
    logp, old, adv = tokens([2.5, 1.0, 1.0], [1.0, -1.0, -1.0])
    _, _, metrics = grad_of("bapo", logp.T, old.T, adv[None, :].clone())
    assert float(metrics["bapo_clip_low"]) == pytest.approx(0.9)
    assert float(metrics["bapo_clip_high"]) == pytest.approx(2.5)


@pytest.mark.parametrize("q,low,high", [(0.9, 0.7687, 1.1872), (0.5, 0.5, 1.3062), (0.1, 0.5, 2.0), (0.01, 0.5, 5.0)])
def test_dcpo_dynamic_bounds_match_the_paper_table(q, low, high):
    # the paper's table is at eps 0.16 / 0.2 (the official script, our default, runs 0.2 / 0.28)
    paper = {"clip_eps_low": 0.16, "clip_eps_high": 0.2}
    # the bounds are where the gradient stops: just inside it flows, just outside it does not (A > 0 above,
    # A < 0 below)
    for r, a, flows in [(high * 0.999, 1.0, True), (high * 1.001, 1.0, False)]:
        old = torch.tensor([[math.log(q)]], dtype=torch.float64)
        _, grad, _ = grad_of(
            "dcpo", old + math.log(r), old, torch.tensor([a], dtype=torch.float64), agg="sum", **paper
        )
        assert (float(grad) != 0) == flows, (q, r)
    if low > 0.5:
        for r, flows in [(low * 1.001, True), (low * 0.999, False)]:
            old = torch.tensor([[math.log(q)]], dtype=torch.float64)
            minus = torch.tensor([-1.0], dtype=torch.float64)
            _, grad, _ = grad_of("dcpo", old + math.log(r), old, minus, agg="sum", **paper)
            assert (float(grad) != 0) == flows, (q, r)
    else:  # r_low = 1/2 whenever q <= 4 eps_low: ratios down to 1/2 keep their gradient
        old = torch.tensor([[math.log(q)]], dtype=torch.float64)
        minus = torch.tensor([-1.0], dtype=torch.float64)
        _, grad, _ = grad_of("dcpo", old + math.log(0.51), old, minus, agg="sum", **paper)
        assert float(grad) != 0


def test_ce_gppo_scales_the_preserved_regions():
    (v1, g1), (v2, g2), (v3, g3) = coef("ce_gppo", [1.5, 0.5, 1.1], [1.0, -1.0, 1.0])
    assert (v1, g1) == pytest.approx((-1.2, -1.2))  # A > 0, r > 1.2: -beta_2 (1 + eps) A, beta_2 = 1
    assert (v2, g2) == pytest.approx((0.4, 0.4))  # A < 0, r < 0.8: -beta_1 (1 - eps) A, beta_1 = 0.5
    assert (v3, g3) == pytest.approx((-1.1, -1.1))  # inside: PPO


def test_pspo_smooths_the_ratio():
    ((value, grad),) = coef("pspo", [1.5], [1.0], alpha=0.2)
    assert (value, grad) == pytest.approx((-1.4, -1.2))
    ((_, grad),) = coef("pspo", [1.5], [1.0], alpha=1.0)
    assert grad == 0.0  # alpha = 1: pi~ = pi_old, nothing to learn


def test_aspo_flips_positive_weights():
    logp, old, adv = tokens([0.5, 0.2, 1.1, 1.3], [1.0, 1.0, 1.0, 1.0])
    entropy = torch.zeros(4, 1, dtype=torch.float64)  # one token per row: at the quantile, eps = 0.2
    grads = []
    for i in range(4):
        _, grad, _ = grad_of(
            "aspo", logp[i : i + 1], old[i : i + 1], adv[i : i + 1], agg="sum", entropy=entropy[i : i + 1]
        )
        grads.append(float(grad))
    assert grads == pytest.approx([-2.0, -3.0, -1 / 1.1, 0.0])  # PPO at r = 0.5 would give -0.5


def test_aspo_widens_the_clip_for_high_entropy_tokens():
    # r = 1.3 > 1.2 is clipped for a low-entropy token but inside 1.4 for the top-20% entropy token
    logp, old, _ = tokens([1.3] * 10, [1.0] * 10)
    entropy = torch.arange(10.0, dtype=torch.float64)[None]
    _, grad, _ = grad_of("aspo", logp.T, old.T, torch.ones(1, dtype=torch.float64), agg="sum", entropy=entropy)
    assert (grad[0, -2:] != 0).all() and (grad[0, :-2] == 0).all()


def test_dispo_masks_outside_its_four_bounds():
    got = coef("dispo", [1.5, 0.7, 1.1, 1.5, 0.7], [1.0, 1.0, 1.0, -1.0, -1.0])
    assert [g for _, g in got] == pytest.approx([0.0, 0.0, -1.1, 0.0, 0.0])


def test_minpro_prefix_minimum_weights():
    # r = [1, 0.5, 2, 1] -> exclusive prefix minimum [1, 1, 0.5, 0.5]; A > 0 inside the clip: grad = -A w r / 4
    logp, old, _ = tokens([1.0, 0.5, 2.0, 1.0], [1.0] * 4)
    loss, grad, metrics = grad_of("minpro", logp.T, old.T, torch.ones(1, dtype=torch.float64), clip_eps_low=10.0)
    torch.testing.assert_close(grad[0], torch.tensor([1.0, 0.5, 1.0, 0.5], dtype=torch.float64) * -1 / 4)
    assert float(metrics["prefix_weight_mean"]) == pytest.approx(0.75)


def test_top_entropy_quantile_keeps_the_forking_tokens():
    # H = 0..9, rho = 0.2: the 0.8 quantile is 7.2 -> tokens 8 and 9 train; the normaliser still counts all 10
    logp, old, _ = tokens([1.0] * 10, [1.0] * 10)
    entropy = torch.arange(10.0, dtype=torch.float64)[None]
    loss, grad, metrics = grad_of("high_entropy", logp.T, old.T, torch.ones(1, dtype=torch.float64), entropy=entropy)
    expected = torch.zeros(10, dtype=torch.float64)
    expected[8:] = -0.1
    torch.testing.assert_close(grad[0], expected)
    assert float(metrics["entropy_kept_frac"]) == pytest.approx(0.2)
    for rho, kept in [(1.0, 10), (0.0, 1)]:
        _, grad, _ = grad_of(
            "dapo", logp.T, old.T, torch.ones(1, dtype=torch.float64), entropy=entropy, top_entropy_quantile=rho
        )
        assert int((grad != 0).sum()) == kept


def test_top_entropy_quantile_keeps_ties_computed_with_rounding_noise():
    # two group members share their first token: the same entropy, off by rounding in batches of other shapes.
    # rho = 0.4 over [0, 1, 2, 5, 5]: the 0.6 quantile is 2 + 0.4 * 3 = 3.2 -> both 5s train, whichever is rounded;
    # over [0, 1, 5, 5, 5]: the quantile is 5 itself, and a 5 rounded down by 1e-7 still trains with the others
    from flowrl.core.objectives import top_entropy_mask

    mask = torch.ones(1, 5, dtype=torch.bool)
    exact = top_entropy_mask(torch.tensor([[0.0, 1.0, 5.0, 5.0, 5.0]]), mask, 0.4)
    noisy = top_entropy_mask(torch.tensor([[0.0, 1.0, 5.0, 5.0 - 4e-7, 5.0]]), mask, 0.4)
    assert exact.tolist() == noisy.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0]]
    # a real gap is not a tie
    assert top_entropy_mask(torch.tensor([[0.0, 1.0, 5.0, 4.99, 5.0]]), mask, 0.4).tolist() == [[0, 0, 1, 0, 1]]


def test_dppo_masks_probability_moves_in_the_advantage_direction():
    # A = +1: q 0.5 -> 0.7 moved 0.2 > 0.15 (masked); 0.5 -> 0.6 kept with gradient -A r = -1.2
    old = torch.tensor([[math.log(0.5)], [math.log(0.5)]], dtype=torch.float64)
    logp = torch.tensor([[math.log(0.7)], [math.log(0.6)]], dtype=torch.float64)
    adv = torch.ones(2, dtype=torch.float64)
    _, grad, _ = grad_of("dppo_tv", logp, old, adv, agg="sum")
    assert grad[:, 0].tolist() == pytest.approx([0.0, -1.2])
    # moving against the advantage is never masked
    _, grad, _ = grad_of("dppo_tv", logp, old, -adv, agg="sum")
    assert grad[:, 0].tolist() == pytest.approx([1.4, 1.2])


def test_vespo_kernel_is_one_at_the_behaviour_policy():
    logp, old, adv, mask, _ = random_batch()
    _, grad, _ = grad_of("vespo", old.clone(), old, adv, mask)
    _, plain, _ = grad_of("gpg", old.clone(), old, adv, mask)
    torch.testing.assert_close(grad, plain)  # phi(1) = 1: on-policy VESPO is REINFORCE


def test_vespo_guards_a_runaway_token_and_averages_its_weight_over_real_tokens():
    # one token with log-ratio 100 (clamped to 20 as trl) in a 3-token sequence, the rest 0: log w = 20, a weight
    # phi = exp(3 + 2 * 20 - 3 e^20) that underflows to exactly 0 instead of NaN/inf
    logp = torch.tensor([[100.0 + math.log(0.5), math.log(0.5), math.log(0.5), 0.0]], dtype=torch.float64)
    old = torch.full_like(logp, math.log(0.5))
    mask = torch.tensor([[True, True, True, False]])
    loss, grad, metrics = grad_of("vespo", logp, old, torch.tensor([1.0], dtype=torch.float64), mask)
    assert torch.isfinite(loss) and torch.equal(grad, torch.zeros_like(grad))
    # each token is clamped before the sum (trl): +100 and -90 count as +20 and -20, log w = 0 and phi = 1, so the
    # gradient is REINFORCE's -A / 3 on each real token (the sum first would give log w = 10 and phi = 0)
    logp = old + torch.tensor([[100.0, -90.0, 0.0, 0.0]], dtype=torch.float64)
    _, grad, _ = grad_of("vespo", logp, old, torch.tensor([1.0], dtype=torch.float64), mask)
    assert grad[0].tolist() == pytest.approx([-1 / 3, -1 / 3, -1 / 3, 0.0])
    # padding takes no part in the weight's mean: on-policy, phi = 1 on the 3 real tokens, the metric is 1 (not 3/4)
    _, _, metrics = grad_of("vespo", old.clone(), old, torch.tensor([1.0], dtype=torch.float64), mask)
    assert float(metrics["vespo_weight_mean"]) == pytest.approx(1.0)


def test_r2vpo_dual_ascent():
    logp, old, adv, mask, _ = random_batch()
    state = get_objective("r2vpo").init_state()
    _, _, m1 = grad_of("r2vpo", logp, old, adv, mask, state=state, var_target=0.0, dual_lr=2.0)
    assert float(m1["r2vpo_lambda"]) == 0.0
    assert state["lambda"] == pytest.approx(2.0 * float(m1["ratio_var"]))  # lambda += eta (Var - delta)
    state_low = {"lambda": 0.5}
    grad_of("r2vpo", old.clone(), old, adv, mask, state=state_low, var_target=0.1, dual_lr=10.0)
    assert state_low["lambda"] == 0.0  # Var 0 < delta: the multiplier decays to 0, never below


def test_clip_cov_zeroes_the_requested_number_of_unclipped_tokens():
    logp, old, adv, mask, _ = random_batch(3, b=8, k=32)
    adv = adv * 5  # covariances of order one
    state = get_objective("clip_cov").init_state()
    loss, grad, metrics = grad_of(
        "clip_cov", logp, old, adv, mask, state=state, cov_fraction=0.05, cov_low=0.0, cov_high=100.0
    )
    _, plain, _ = grad_of("ppo", logp, old, adv, mask)
    dropped = (plain != 0) & (grad == 0)
    assert int(dropped.sum()) == int(0.05 * int(mask.sum()))
    assert state["calls"] == 1
    # the draw depends on the call count: a resumed state draws the same tokens
    _, again, _ = grad_of(
        "clip_cov", logp, old, adv, mask, state={"calls": 0}, cov_fraction=0.05, cov_low=0.0, cov_high=100.0
    )
    torch.testing.assert_close(again, grad)


def test_kl_cov_penalises_exactly_the_top_k_tokens():
    logp, old, adv, mask, _ = random_batch(4, b=8, k=32)
    _, _, metrics = grad_of("kl_cov", logp, old, adv, mask, cov_fraction=0.1)
    assert float(metrics["cov_selected_frac"]) * int(mask.sum()) == pytest.approx(int(0.1 * int(mask.sum())))


def test_segment_ratio_objectives_interpolate_between_token_and_sequence():
    logp, old, adv, mask, entropy = random_batch(5)
    b, k = logp.shape
    one_segment = torch.zeros(b, k, dtype=torch.long)
    each_token = torch.arange(k).expand(b, k).clone()
    gspo = grad_of("gspo", logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, agg="token_mean")
    turn_seq = grad_of("turn_ppo", logp, old, adv, mask, segment_ids=one_segment)
    torch.testing.assert_close(turn_seq[:2], gspo[:2])  # one turn per response: GSPO with PPO's clip
    turn_tok = grad_of("turn_ppo", logp, old, adv, mask, segment_ids=each_token)
    ppo = grad_of("ppo", logp, old, adv, mask)
    torch.testing.assert_close(turn_tok[:2], ppo[:2])  # one token per turn: PPO
    espo_one = grad_of("espo", logp, old, adv, mask, entropy=torch.ones_like(entropy), num_groups=1)
    torch.testing.assert_close(espo_one[:2], gspo[:2])  # one entropy group, flat entropy: GSPO with PPO's clip
    for w, target in [(1.0, ppo), (0.0, gspo)]:
        dhpo = grad_of("dhpo", logp, old, adv, mask, mix=w)
        torch.testing.assert_close(dhpo[:2], target[:2])


def test_entropy_groups_have_equal_counts_by_rank():
    entropy = torch.tensor([[0.5, 0.1, 0.9, 0.3, 0.7, 9.0]])
    mask = torch.tensor([[True, True, True, True, True, False]])
    groups = entropy_groups(entropy, mask, 2)
    assert groups[0, :5].tolist() == [0, 0, 1, 0, 1]  # ranks 2, 0, 4, 1, 3 of 5 -> (rank * 2) // 5


def test_extra_inputs_are_required_with_a_clear_message():
    logp, old, adv, mask, _ = random_batch()
    with pytest.raises(ValueError, match="needs entropy="):
        compute_policy_loss("aspo", logp, old, adv, mask)
    with pytest.raises(ValueError, match="needs segment_ids="):
        compute_policy_loss("turn_ppo", logp, old, adv, mask)
    with pytest.raises(ValueError, match="needs state="):
        compute_policy_loss("r2vpo", logp, old, adv, mask)
    with pytest.raises(ValueError, match="entropy must have shape"):
        compute_policy_loss("aspo", logp, old, adv, mask, entropy=torch.zeros(2, 2))


@pytest.mark.parametrize(
    "name,inputs",
    [
        ("bnpo", {}),
        ("gmpo", {}),
        ("bapo", {}),
        ("dcpo", {}),
        ("ce_gppo", {}),
        ("pspo", {}),
        ("aspo", {"e": 1}),
        ("dispo", {}),
        ("turn_ppo", {"s": 1}),
        ("sspo", {"e": 1, "s": 1}),
        ("espo", {"e": 1}),
        ("dhpo", {}),
        ("minpro", {}),
        ("high_entropy", {"e": 1}),
        ("clip_cov", {}),
        ("kl_cov", {}),
        ("r2vpo", {}),
        ("dro", {}),
        ("gpg", {}),
        ("dppo_tv", {}),
        ("dppo_kl", {}),
        ("vespo", {}),
        ("luspo", {}),
    ],
)
def test_gradient_at_the_old_weights_is_the_policy_gradient(name, inputs):
    """At logp = old_logp every objective's gradient is the (aggregated) policy gradient -A grad(log pi), up to
    its token selection and regulariser terms that vanish at r = 1 (the reference notes' invariant)."""
    logp, old, adv, mask, entropy = random_batch(7)
    kw = {}
    if "e" in inputs:
        kw["entropy"] = entropy
    if "s" in inputs:
        kw["segment_ids"] = (torch.arange(logp.shape[1]) // 3).expand_as(logp).clone()
    objective = get_objective(name)
    if objective.init_state is not None:
        kw["state"] = objective.init_state()
    loss, grad, metrics = grad_of(name, old.clone(), old, adv, mask, **kw)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
    agg = objective.agg
    x = old.clone().requires_grad_(True)
    from flowrl.core import aggregate

    pg = aggregate(-adv[:, None] * (x - x.detach()).exp(), mask.double(), agg)
    (expected,) = torch.autograd.grad(pg, x)
    if name == "pspo":
        expected = expected * 0.9  # smoothing scales the on-policy gradient by 1 - alpha
    if name == "high_entropy":
        expected = expected * (grad != 0)  # only the kept tokens train
    if name == "clip_cov":
        expected = expected * (grad != 0)  # the randomly dropped tokens do not
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# parity with direct autograd implementations of the published formulas (fp64, random ragged batches)
# ----------------------------------------------------------------------------------------------


def _seq_mean(x, mask):
    m = mask.double()
    return (x * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)


def test_gmpo_parity():
    def ref(lp, lq, a, m, h):
        d = lp - lq
        s = torch.where(a[:, None] >= 0, 1.0, -1.0).double()
        dt = s * torch.minimum(s * d, s * d.clamp(-0.4, 0.4))
        return (-a * torch.exp(_seq_mean(dt, m)[:, 0])).mean()

    assert_parity("gmpo", ref)


def test_bapo_parity():
    def ref(lp, lq, a, m, h):
        r = (lp - lq).exp()
        rd, ad = r.detach(), a[:, None].expand_as(r)
        pos = lambda hi: float((rd * ad * ((ad > 0) & m & (rd <= hi))).sum())  # noqa: E731
        neg = lambda lo: float((rd * -ad * ((ad < 0) & m & (rd >= lo))).sum())  # noqa: E731
        lo, hi = 0.6, 1.2
        while pos(hi) < 0.5 * (pos(hi) + neg(lo)) and lo < 0.9 - 1e-9:
            lo = round(lo + 0.05, 10)
        while pos(hi) < 0.5 * (pos(hi) + neg(lo)) and hi < 3.0 - 1e-9:
            hi = round(hi + 0.1, 10)
        loss = ppo_terms(r, ad, torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
        loss = torch.where(ad < 0, torch.minimum(loss, -ad * 3.0), loss)
        return token_mean(loss, m)

    assert_parity("bapo", ref)


def test_dcpo_parity():
    def ref(lp, lq, a, m, h):
        q, r, ad = lq.exp(), (lp - lq).exp(), a[:, None].expand_as(lp)
        # the official script's eps: clip_ratio_low 0.2 (run_base.sh), clip_ratio_high 0.28 (run_dcpo.sh)
        low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1 - 4 * 0.2 / q, min=0))
        high = torch.clamp(0.5 + 0.5 * torch.sqrt(1 + 4 * 0.28 / q), max=10.0)
        loss = ppo_terms(r, ad, low, high)
        return token_mean(torch.where(ad < 0, torch.minimum(loss, -ad * 10.0), loss), m)

    assert_parity("dcpo", ref)


def test_ce_gppo_parity():
    def ref(lp, lq, a, m, h):
        r, ad = (lp - lq).exp(), a[:, None].expand_as(lp)
        g = r / r.detach()
        loss = torch.where(
            (ad < 0) & (r < 0.8), -0.5 * 0.8 * g * ad, torch.where((ad > 0) & (r > 1.2), -1.2 * g * ad, -r * ad)
        )
        return token_mean(torch.where(ad < 0, torch.minimum(loss, -ad * 10.0), loss), m)

    assert_parity("ce_gppo", ref)


def test_pspo_parity():
    def ref(lp, lq, a, m, h):
        return token_mean(-a[:, None] * (0.9 * (lp - lq).exp() + 0.1), m)

    assert_parity("pspo", ref)


def test_aspo_parity():
    def ref(lp, lq, a, m, h):
        r, ad = (lp - lq).exp(), a[:, None].expand_as(lp)
        cut = torch.stack([torch.quantile(h[i][m[i]], 0.8) for i in range(len(h))])[:, None]
        eps = torch.where(h > cut, 0.4, 0.2).double()
        rt = torch.minimum(r, 1 + eps)  # A > 0
        pos = -ad * (rt / rt.detach()) / rt.detach()
        pos = torch.where(1 / rt.detach() > 3, -ad * 3 * lp, pos)
        rb = torch.maximum(r, 1 - eps)  # A < 0
        neg = torch.where(rb.detach() > 3, -ad * 3 * lp, -ad * rb)
        return token_mean(torch.where(ad > 0, pos, neg), m)

    assert_parity("aspo", ref, seed=1)


def test_dispo_parity():
    def ref(lp, lq, a, m, h):
        r, ad = (lp - lq).exp().detach(), a[:, None].expand_as(lp)
        band = torch.where(ad > 0, (r >= 0.8) & (r <= 1.28), (r >= 0.8) & (r <= 1.28))
        return token_mean(-ad * torch.where(band, r, 0.0) * lp, m)

    assert_parity("dispo", ref)


def test_minpro_parity():
    def ref(lp, lq, a, m, h):
        r, ad = (lp - lq).exp(), a[:, None].expand_as(lp)
        w = torch.ones_like(r)
        for i in range(r.shape[0]):
            running = math.inf
            for t in range(r.shape[1]):
                w[i, t] = 1.0 if math.isinf(running) else running
                if m[i, t]:
                    running = min(running, float(r[i, t].detach()))
        return token_mean(
            w * ppo_terms(r, ad, torch.tensor(0.8, dtype=torch.float64), torch.tensor(1.2, dtype=torch.float64)), m
        )

    assert_parity("minpro", ref)


def test_kl_cov_parity():
    def ref(lp, lq, a, m, h):
        r, ad = (lp - lq).exp(), a[:, None].expand_as(lp)
        md = m.double()
        cov = (ad - (ad * md).sum() / md.sum()) * (lp.detach() - (lp.detach() * md).sum() / md.sum())
        k = max(1, int(2e-4 * int(m.sum())))
        top = torch.zeros_like(m)
        top.view(-1)[torch.topk(torch.where(m, cov, -math.inf).view(-1), k).indices] = True
        return token_mean(-ad * r + top * (lp - lq).abs(), m)

    assert_parity("kl_cov", ref)


def test_r2vpo_parity():
    def ref(lp, lq, a, m, h):
        r = (lp - lq).exp()
        md = m.double()
        mean = (r * md).sum() / md.sum()
        var = ((r - mean) ** 2 * md).sum() / md.sum()
        return token_mean(-a[:, None] * r, m) + 0.7 * (var - 0.01)

    assert_parity("r2vpo", ref, state={"lambda": 0.7})


def test_dro_and_gpg_parity():
    assert_parity("dro", lambda lp, lq, a, m, h: token_mean(-(lp * a[:, None] - 0.5 * (lp - lq) ** 2), m))
    assert_parity("gpg", lambda lp, lq, a, m, h: token_mean(-a[:, None] * lp, m))


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_parity(divergence):
    def ref(lp, lq, a, m, h):
        p, q, ad = lp.exp().detach(), lq.exp(), a[:, None].expand_as(lp)
        r = (lp - lq).exp().detach()
        if divergence == "tv":
            keep = torch.where(ad > 0, p - q <= 0.15, p - q >= -0.15)
        else:
            kl = q * (lq - lp.detach()) + (1 - q) * torch.log((1 - q) / (1 - p))
            keep = torch.where(ad > 0, (kl <= 0.05) | (p <= q), (kl <= 0.05) | (p >= q))
        return token_mean(-ad * torch.where(keep, r.clamp(max=20.0), 0.0) * lp, m)

    assert_parity(f"dppo_{divergence}", ref)


def test_vespo_parity():
    def ref(lp, lq, a, m, h):
        logw = ((lp - lq).detach().clamp(-20, 20) * m).sum(-1, keepdim=True).clamp(math.log(1e-8), 20)
        w, ad = logw.exp(), a[:, None]
        k, lam = torch.where(ad >= 0, 2.0, 3.0).double(), torch.where(ad >= 0, 3.0, 2.0).double()
        phi = w**k * torch.exp(lam * (1 - w))
        return token_mean(-phi * ad * lp, m)

    assert_parity("vespo", ref)


def test_luspo_parity():
    def ref(lp, lq, a, m, h):
        s = torch.exp(_seq_mean(lp - lq, m))[:, 0]
        seq = torch.maximum(-a * s, -a * s.clamp(1 - 2e-3, 1 + 2.5e-3))
        return (seq * m.sum(-1)).mean()  # trl: mean_i(l_i |o_i|)

    assert_parity("luspo", ref)


def test_sspo_and_espo_parity():
    def segment_ref(lp, lq, m, ids, h, eps_of):
        """Clip each segment's geometric-mean ratio in the segment's own entropy-scaled range."""
        d = lp - lq
        md = m.double()
        out_ratio, out_eps = torch.zeros_like(d), torch.zeros_like(d)
        h_bar = (h * md).sum() / md.sum()
        for i in range(d.shape[0]):
            for seg in ids[i][m[i]].unique():
                sel = m[i] & (ids[i] == seg)
                out_ratio[i] = torch.where(sel, d[i][sel].mean().exp(), out_ratio[i])
                out_eps[i] = torch.where(sel, eps_of(h[i][sel].mean() / h_bar), out_eps[i])
        return out_ratio, out_eps

    def clip_ref(r, a, eps, m):
        return token_mean(ppo_terms(r, a[:, None].expand_as(r), 1 - eps, 1 + eps), m)

    eps_of = lambda x: 0.2 * x.clamp(0.5, 2.0)  # noqa: E731
    ids_fixed = (torch.arange(9) // 3).expand(6, 9).clone()

    def sspo_ref(lp, lq, a, m, h):
        r, eps = segment_ref(lp, lq, m, ids_fixed, h, eps_of)
        return clip_ref(r, a, eps, m)

    assert_parity("sspo", sspo_ref, segment_ids=ids_fixed)

    def espo_ref(lp, lq, a, m, h):
        ids = torch.zeros_like(lp, dtype=torch.long)
        for i in range(lp.shape[0]):
            valid = torch.nonzero(m[i]).reshape(-1)
            order = valid[h[i][valid].argsort(stable=True)]
            for rank, t in enumerate(order.tolist()):
                ids[i, t] = rank * 4 // len(valid)
        r, eps = segment_ref(lp, lq, m, ids, h, eps_of)
        return clip_ref(r, a, eps, m)

    assert_parity("espo", espo_ref)


def test_dhpo_parity():
    def ref(lp, lq, a, m, h):
        r, ad = (lp - lq).exp(), a[:, None].expand_as(lp)
        s = torch.exp(_seq_mean(lp - lq, m)).expand_as(r)
        pess = lambda x: torch.where(ad >= 0, torch.minimum(x, x.clamp(0.8, 1.2)), torch.maximum(x, x.clamp(0.8, 1.2)))  # noqa: E731
        return token_mean(-ad * pess(r) ** 0.3 * pess(s) ** 0.7, m)

    assert_parity("dhpo", ref, mix=0.3)


# ----------------------------------------------------------------------------------------------
# batch statistics are global: two processes (gloo) see the statistics of the concatenated batch
# ----------------------------------------------------------------------------------------------


def _two_process_worker(rank, init_file, out_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    logp, old, adv, mask, entropy = random_batch(11, b=8, k=12)
    rows = slice(4 * rank, 4 * rank + 4)
    results = {}
    _, grad, metrics = grad_of("high_entropy", logp[rows], old[rows], adv[rows], mask[rows], entropy=entropy[rows])
    results["kept"] = (grad != 0).tolist()
    _, _, metrics = grad_of("bapo", logp[rows], old[rows], adv[rows] * 3, mask[rows])
    results["bapo"] = [float(metrics["bapo_clip_low"]), float(metrics["bapo_clip_high"])]
    state = {"lambda": 0.0}
    grad_of("r2vpo", logp[rows], old[rows], adv[rows], mask[rows], state=state, var_target=0.0, dual_lr=1.0)
    results["lambda"] = state["lambda"]
    torch.save(results, f"{out_file}.{rank}")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_batch_statistics_are_global_across_processes(tmp_path):
    """The 80/20 entropy quantile, BAPO's bounds and R2VPO's variance of two processes holding half a batch each
    equal those of one process holding all of it."""
    import torch.multiprocessing as mp

    mp.spawn(_two_process_worker, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"out.{r}", weights_only=True) for r in range(2)]
    logp, old, adv, mask, entropy = random_batch(11, b=8, k=12)
    _, grad, _ = grad_of("high_entropy", logp, old, adv, mask, entropy=entropy)
    assert parts[0]["kept"] + parts[1]["kept"] == (grad != 0).tolist()
    _, _, metrics = grad_of("bapo", logp, old, adv * 3, mask)
    whole = [float(metrics["bapo_clip_low"]), float(metrics["bapo_clip_high"])]
    assert parts[0]["bapo"] == parts[1]["bapo"] == pytest.approx(whole)
    state = {"lambda": 0.0}
    grad_of("r2vpo", logp, old, adv, mask, state=state, var_target=0.0, dual_lr=1.0)
    assert parts[0]["lambda"] == parts[1]["lambda"] == pytest.approx(state["lambda"])


def _long_batch(seed=0, B=6, K=100):
    """A token-length batch (K > 64, the long-sequence paths) with NaN padding and one empty row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, K + 1, (B,), generator=g)
    lengths[2] = 0
    mask = torch.arange(K) < lengths[:, None]  # [B, K]
    logp = -3.0 * torch.rand(B, K, generator=g, dtype=torch.float64)
    old = logp + 0.05 * torch.randn(B, K, generator=g, dtype=torch.float64)
    old = old + 0.02 * torch.randn(B, 1, generator=g, dtype=torch.float64)  # sequence ratios leave the clip range
    old = torch.where(mask, old, torch.nan)
    return logp, old, torch.randn(B, generator=g, dtype=torch.float64), mask, torch.rand(B, K, generator=g)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "sum"])
@pytest.mark.parametrize("name", ["gspo", "luspo", "gmpo"])
def test_sequence_objectives_run_their_surrogate_per_row_with_the_same_loss_gradient_and_metrics(
    name, agg, monkeypatch
):
    from flowrl.core import policy_loss

    calls = []
    row_metrics = policy_loss._row_metrics
    monkeypatch.setattr(policy_loss, "_row_metrics", lambda *a: calls.append(1) or row_metrics(*a))
    logp, old, adv, mask, weights = _long_batch()
    results = []
    for advantages in (adv, adv[:, None].expand_as(logp)):  # [B, K] advantages take the element path
        x = logp.clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(name, x, old, advantages, mask, agg=agg, weights=weights)
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    assert calls == [1]  # only the [B] advantages ran row-level
    (loss_row, grad_row, m_row), (loss_el, grad_el, m_el) = results
    if name != "gmpo":  # GMPO clips inside its log-ratio, it has no clip flags
        assert 0.1 < m_el["clipfrac"] < 0.9  # both sides of the clip are exercised
    torch.testing.assert_close(loss_row, loss_el, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_row, grad_el, rtol=1e-12, atol=1e-14)
    assert grad_row[~mask].eq(0).all()
    assert set(m_row) == set(m_el)
    for key in m_row:
        torch.testing.assert_close(m_row[key], m_el[key], rtol=1e-9, atol=1e-12, msg=key)


@pytest.mark.parametrize("name", ["ppo", "dapo", "cispo", "sapo", "gspo", "vespo", "bapo"])
def test_diagnostics_levels_report_subsets_of_the_same_numbers(name):
    logp, old, adv, mask, _ = _long_batch(seed=1)
    extra = {"state": get_objective(name).init_state()} if get_objective(name).init_state else {}
    full = compute_policy_loss(name, logp, old, adv, mask, **extra)
    clip = compute_policy_loss(name, logp, old, adv, mask, diagnostics="clip", **extra)
    none = compute_policy_loss(name, logp, old, adv, mask, diagnostics="none", **extra)
    assert full[0] == clip[0] == none[0]
    own = set(none[1])
    assert set(clip[1]) == {"clipfrac", "clipfrac_high", "clipfrac_low", "clipfrac_dual"} | own
    assert {"ratio_mean", "ratio_std", "ratio_min", "ratio_max", "approx_kl_k3"} <= set(full[1])
    for key, value in clip[1].items():
        torch.testing.assert_close(value, full[1][key], msg=key)
    with pytest.raises(ValueError, match="diagnostics.*'sparse'.*full"):
        compute_policy_loss(name, logp, old, adv, mask, diagnostics="sparse", **extra)


def test_long_sequence_metrics_match_their_definitions():
    logp, old, adv, mask, _ = _long_batch(seed=2)
    _, m = compute_policy_loss("dapo", logp, old, adv, mask)
    lr = (logp - old)[mask]
    ratio = lr.exp()
    torch.testing.assert_close(m["ratio_mean"], ratio.mean())
    torch.testing.assert_close(m["ratio_std"], ratio.std(unbiased=False))
    torch.testing.assert_close(m["ratio_min"], ratio.min())
    torch.testing.assert_close(m["ratio_max"], ratio.max())
    torch.testing.assert_close(m["approx_kl_k3"], (torch.expm1(lr) - lr).mean())
    a = adv[:, None].expand_as(logp)[mask]
    high = ((ratio > 1.28) & (a > 0)).double().mean()
    low = ((ratio < 0.8) & (a < 0)).double().mean()
    torch.testing.assert_close(m["clipfrac_high"], high)
    torch.testing.assert_close(m["clipfrac_low"], low)
