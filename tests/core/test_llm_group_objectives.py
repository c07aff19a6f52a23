"""The group objectives (`flowrl.core.text.group`): TRPA, Reg-GRPO, GTPO, ST-PPO.

Hand-computed values on tiny tensors (the arithmetic in the comments), value/gradient parity with direct autograd
implementations of the published formulas (fp64, ragged rows, several groups), the invariants each has at the old
weights, and a few epochs of each on the arithmetic task through the text trainer."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from flowrl.core import compute_policy_loss, get_objective
from flowrl.core.text.group import conflict_runs, row_groups


def grad_of(name, logp, old, adv, mask=None, **kw):
    """Loss of `name` and its gradient with respect to `logp`."""
    logp = logp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(name, logp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


def ragged(seed, groups=(3, 4), k=6, dtype=torch.float64):
    """Two groups of rows with ragged lengths: logp, old, ref, mask, group ids `[B, K]`, entropy."""
    g = torch.Generator().manual_seed(seed)
    b = sum(groups)
    old = -torch.rand(b, k, generator=g, dtype=dtype) * 2 - 0.05
    logp = (old + 0.3 * torch.randn(b, k, generator=g, dtype=dtype)).clamp_max(-1e-3)
    ref = old + 0.2 * torch.randn(b, k, generator=g, dtype=dtype)
    mask = torch.ones(b, k, dtype=torch.bool)
    for i in range(b):
        mask[i, k - i % 3 :] = False
    logp = torch.where(mask, logp, torch.nan)  # padding never reaches the loss
    group = torch.cat([torch.full((n,), 7 * (j + 1)) for j, n in enumerate(groups)])[:, None].expand(b, k)
    entropy = torch.rand(b, k, generator=g, dtype=dtype)
    return logp, old, ref, mask, group, entropy


def group_advantages(rewards, sizes):
    """GRPO's group z-scores (sample std, eps 1e-4) of `rewards` in consecutive groups of `sizes`."""
    out, start = [], 0
    for n in sizes:
        r = torch.tensor(rewards[start : start + n], dtype=torch.float64)
        out.append((r - r.mean()) / (r.std() + 1e-4) if r.std() > 0 else torch.zeros_like(r))
        start += n
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def test_row_groups_read_one_id_per_row_and_skip_empty_rows():
    mask = torch.tensor([[True, False], [False, False], [True, True]])
    group = torch.tensor([[3, 99], [4, 4], [5, 5]])  # padding may hold anything
    assert row_groups(group, mask).tolist() == [3, -1, 5]
    assert row_groups(torch.tensor([3.0, 4.0, 5.0]), mask).tolist() == [3, -1, 5]
    with pytest.raises(ValueError, match="non-negative"):
        row_groups(torch.tensor([-2, 0, 0]), mask)


# ----------------------------------------------------------------------------------------------
# TRPA
# ----------------------------------------------------------------------------------------------


def test_trpa_hand_computed():
    # one group, three levels (advantages 1 > 0 > -1), two tokens per row, at the old weights (x = 0: no KL)
    # z = mean_t (logp - ref) = [0.5, 0, -0.5]; beta 0.1, anisotropy 2.5 for pairs won by the top row:
    #   (0 > 1): h = 2.5 * 0.1 * 0.5 = 0.125,  (0 > 2): h = 2.5 * 0.1 * 1.0 = 0.25,  (1 > 2): h = 0.1 * 0.5 = 0.05
    # L = mean softplus(-h) = (0.632599 + 0.575939 + 0.668460) / 3 = 0.625666
    # dL/dz_0 = -(sigma(-0.125) 0.25 + sigma(-0.25) 0.25) / 3, dL/dz_1 = (sigma(-0.125) 0.25 - sigma(-0.05) 0.1) / 3,
    # dL/dz_2 = (sigma(-0.25) 0.25 + sigma(-0.05) 0.1) / 3 with sigma(-0.125) = 0.468791, sigma(-0.25) = 0.437823,
    # sigma(-0.05) = 0.487503, and dz_i/dlogp_it = 1/2: -0.0377756, 0.0114079, 0.0263677 per token
    old = torch.full((3, 2), -1.0, dtype=torch.float64)
    z = torch.tensor([0.5, 0.0, -0.5], dtype=torch.float64)[:, None]
    ref = old - z
    adv = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    loss, grad, metrics = grad_of("trpa", old, old, adv, group=torch.zeros(3, 2), ref_logp=ref)
    assert float(loss) == pytest.approx(0.6256660344030996, abs=1e-12)
    expected = torch.tensor([-0.037775588572518566, 0.011407899384163664, 0.026367689188354904], dtype=torch.float64)
    torch.testing.assert_close(grad, expected[:, None].expand(3, 2), rtol=1e-10, atol=1e-12)
    assert float(metrics["trpa_pairs"]) == 3 and float(metrics["trpa_accuracy"]) == 1.0
    assert float(metrics["trpa_margin"]) == pytest.approx((0.125 + 0.25 + 0.05) / 3 / 0.1)


def trpa_reference(logp, old, ref, adv, mask, group, beta=0.1, anisotropy=2.5, tr_kl_coef=1e-3):
    """TRPA as the official code computes it (pairs by nested loops over a group's levels), with the levels the
    group's distinct advantages and the token-mean k3 trust region."""
    fm = mask.double()
    logp, old, ref = torch.where(mask, logp, 0.0), torch.where(mask, old, 0.0), torch.where(mask, ref, 0.0)
    z = ((logp - ref) * fm).sum(-1) / fm.sum(-1)
    ids = group[:, 0]
    hs = []
    for g in ids.unique():
        rows = (ids == g).nonzero().flatten().tolist()
        top = max(float(adv[i]) for i in rows)
        for i in rows:
            for j in rows:
                if adv[i] > adv[j]:
                    kappa = anisotropy if float(adv[i]) == top else 1.0
                    hs.append(kappa * beta * (z[i] - z[j]))
    pairs = -F.logsigmoid(torch.stack(hs)).mean()
    x = logp - old
    k3 = (torch.exp(-x) + x - 1).clamp(-10, 10)
    return pairs + tr_kl_coef * (k3 * fm).sum() / fm.sum()


@pytest.mark.parametrize("seed", [0, 1])
def test_trpa_matches_the_official_pairwise_loss(seed):
    logp, old, ref, mask, group, _ = ragged(seed)
    # three reward levels in the first group (with a tie), two in the second
    adv = group_advantages([1.0, 0.5, 0.5, 1.0, 0.0, 0.0, 1.0], (3, 4))
    loss, grad, _ = grad_of("trpa", logp, old, adv, mask, group=group, ref_logp=ref, tr_kl_coef=0.05)
    x = logp.clone().requires_grad_(True)
    expected = trpa_reference(x, old, ref, adv, mask, group, tr_kl_coef=0.05)
    (expected_grad,) = torch.autograd.grad(expected, x)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, torch.where(mask, expected_grad, 0.0), rtol=1e-10, atol=1e-12)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_trpa_at_the_reference_is_dr_grpo_reinforce_for_binary_rewards():
    # anisotropy 1, z = 0 (policy = reference = old): every pair's slope is beta/2, so row i's gradient counts its
    # pairs: a correct row -q beta/2, a wrong one +p beta/2 (p correct, q wrong): proportional to -(r - mean r)
    logp, old, _, mask, group, _ = ragged(2, groups=(4, 4))
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    adv = group_advantages(rewards.tolist(), (4, 4))
    _, grad, _ = grad_of("trpa", old, old, adv, mask, group=group, ref_logp=old, anisotropy=1.0)
    centred = rewards - torch.stack([rewards[:4].mean()] * 4 + [rewards[4:].mean()] * 4)
    n = mask.sum(-1, keepdim=True).double()
    baseline = -centred[:, None] / n * mask  # Dr.GRPO's REINFORCE per token, each row's mean over its tokens
    # 3 pairs in each group (1 x 3 and 3 x 1), P = 6: the factor is beta G / (2 P) = 0.1 * 4 / 12
    torch.testing.assert_close(grad, 0.1 * 4 / 12 * baseline, rtol=1e-10, atol=1e-13)


def test_trpa_ties_and_single_level_groups_give_no_pairs():
    logp, old, ref, mask, group, _ = ragged(3)
    adv = torch.zeros(7, dtype=torch.float64)  # every group at one level: the trust region alone trains
    loss, grad, metrics = grad_of("trpa", logp, old, adv, mask, group=group, ref_logp=ref)
    x = torch.where(mask, logp - old, 0.0)
    k3 = (torch.exp(-x) + x - 1) * mask
    assert float(metrics["trpa_pairs"]) == 1.0  # the clamp of an empty count
    assert float(loss) == pytest.approx(1e-3 * float(k3.sum() / mask.sum()), rel=1e-10)


# ----------------------------------------------------------------------------------------------
# Reg-GRPO
# ----------------------------------------------------------------------------------------------


def test_reg_grpo_hand_computed():
    # one group, one token per row: rho = x = [0.3, 0.1, -0.1], mean 0.1, d = [0.2, 0, -0.2],
    # sample std sqrt((0.04 + 0 + 0.04) / 2) = 0.2, s = 0.2 + 1e-4 = 0.2001,
    # A_theta = d / s = [0.9995002, 0, -0.9995002]
    # A = [1, -0.5, -0.5]: e = A_theta - A = [-0.00049975, 0.5, -0.49950025]; L = mean e^2 = 0.16650025
    old = torch.full((3, 1), -1.0, dtype=torch.float64)
    logp = old + torch.tensor([[0.3], [0.1], [-0.1]], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, -0.5], dtype=torch.float64)
    loss, grad, metrics = grad_of("reg_grpo", logp, old, adv, group=torch.zeros(3))
    assert float(loss) == pytest.approx(0.16650024979181247, rel=1e-10)
    assert float(metrics["reg_grpo_rho_std"]) == pytest.approx(0.2, rel=1e-10)
    # the gradient of the same formula by autograd (torch.std is the sample std)
    x = logp.clone().requires_grad_(True)
    rho = (x - old)[:, 0]
    ref = ((adv - (rho - rho.mean()) / (rho.std() + 1e-4)) ** 2).mean()
    (ref_grad,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def reg_grpo_reference(logp, old, adv, mask, group, eps=1e-4, seq_reduce="sum"):
    """(1/B) sum over groups of sum_i (A_i - (rho_i - mean rho) / (std rho + eps))^2, by autograd."""
    fm = mask.double()
    x = torch.where(mask, logp - old, 0.0)
    rho = (x * fm).sum(-1)
    if seq_reduce == "mean":
        rho = rho / fm.sum(-1)
    ids = group[:, 0]
    total = 0.0
    for g in ids.unique():
        rows = ids == g
        r = rho[rows]
        total = total + ((adv[rows] - (r - r.mean()) / (r.std() + eps)) ** 2).sum()
    return total / len(ids)


@pytest.mark.parametrize("seq_reduce", ["sum", "mean"])
def test_reg_grpo_matches_the_regression_by_autograd(seq_reduce):
    logp, old, _, mask, group, _ = ragged(4)
    adv = group_advantages([1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.0], (3, 4))
    loss, grad, _ = grad_of("reg_grpo", logp, old, adv, mask, group=group, seq_reduce=seq_reduce)
    x = logp.clone().requires_grad_(True)
    expected = reg_grpo_reference(x, old, adv, mask, group, seq_reduce=seq_reduce)
    (expected_grad,) = torch.autograd.grad(expected, x)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, torch.where(mask, expected_grad, 0.0), rtol=1e-9, atol=1e-12)


def test_reg_grpo_at_the_old_weights_is_scaled_grpo_reinforce():
    # rho = 0 for every response: A_theta = 0, and with L = (1/B) sum_i e_i^2, dL/drho_i = (2/B) (e_i - mean_g e) / eps
    # = -2 A_i / (B eps) since a group's z-scores sum to zero: GRPO's sequence-level REINFORCE (`reinforce` on the
    # summed tokens, -A_i / B per token) times 2 / eps
    logp, old, _, mask, group, _ = ragged(5, groups=(4, 4))
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0], (4, 4))
    assert abs(float(adv[:4].sum())) < 1e-12 and abs(float(adv[4:].sum())) < 1e-12
    _, grad, metrics = grad_of("reg_grpo", old, old, adv, mask, group=group)
    _, baseline, _ = grad_of("reinforce", old, old, adv, mask, agg="seq_mean_token_sum")
    torch.testing.assert_close(grad, 2 / 1e-4 * baseline, rtol=1e-10, atol=1e-10)
    assert float(metrics["reg_grpo_mse"]) == pytest.approx(float((adv**2).mean()), rel=1e-12)


def test_reg_grpo_is_minimised_where_the_log_ratios_reproduce_the_advantages():
    # rho = 0.3 A + 0.05 (any positive affine image of the z-scores A): A_theta = A up to eps, loss and gradient ~ 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    adv = (rewards - rewards.mean()) / rewards.std()
    old = torch.full((5, 1), -1.0, dtype=torch.float64)
    logp = old + 0.3 * adv[:, None] + 0.05
    loss, grad, _ = grad_of("reg_grpo", logp, old, adv, group=torch.zeros(5), eps=1e-12)
    assert float(loss) < 1e-16 and float(grad.abs().max()) < 1e-6


# ----------------------------------------------------------------------------------------------
# GTPO
# ----------------------------------------------------------------------------------------------


def gtpo_batch():
    """One group: a positive row, a shorter negative one sharing its first two tokens and its last, an inactive
    (A = 0) row; token ids and entropies."""
    ids = torch.tensor([[5, 6, 7, 9], [5, 6, 9, 0], [5, 6, 7, 9]])
    mask = torch.tensor([[True] * 4, [True, True, True, False], [True] * 4])
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    entropy = torch.tensor([[0.5] * 4, [0.2] * 4, [1.0] * 4], dtype=torch.float64)
    return ids, mask, adv, entropy


def test_gtpo_conflict_runs_hand_computed():
    ids, mask, adv, _ = gtpo_batch()
    # leading: positions 0, 1 hold 5, 6 in the positive and the negative row (the inactive row never counts);
    # position 2: 7 vs 9 ends the run. Trailing (aligned at the ends): both end with 9; then 7 vs 6 ends it.
    leading, trailing = conflict_runs(ids, mask, torch.zeros(3, dtype=torch.long), adv > 0, adv < 0)
    assert leading.tolist() == [[True, True, False, False], [True, True, False, False], [False] * 4]
    assert trailing.tolist() == [[False, False, False, True], [False, False, True, False], [False] * 4]
    # the same tokens in different groups are no conflict
    leading, trailing = conflict_runs(ids, mask, torch.tensor([0, 1, 0]), adv > 0, adv < 0)
    assert not leading.any() and not trailing.any()


def test_gtpo_hand_computed():
    ids, mask, adv, entropy = gtpo_batch()
    # delta: positive row [2, 2, 1, 2] (W = 2 on its 3 conflict tokens), negative row [0, 0, 0] (all 3 conflict),
    # inactive row 1s; conflicts c = [3, 3, 0 -> 1]
    # entropy guard: H = [0.5, 0.2, 1.0]; A' = [1 - 0.1 * 0.5, -1 - 0.1 * 0.2, 0 (H > 0.7)] = [0.95, -1.02, 0]
    # seq_mean_token_mean: L = (1/3) [(1/4) sum_t -0.95 delta_t / 3 + 0 + 0] = -(0.95 * 7) / 36 = -0.18472222
    # gradient per token of row 0: -0.95 delta_t / 3 / (3 rows * 4 tokens) = [-0.0527778, -0.0527778, -0.0263889, ...]
    old = torch.full((3, 4), -1.0, dtype=torch.float64)
    loss, grad, metrics = grad_of("gtpo", old, old, adv, mask, entropy=entropy, group=torch.zeros(3, 4), token_ids=ids)
    assert float(loss) == pytest.approx(-0.95 * 7 / 36, rel=1e-12)
    row0 = -0.95 / 3 / 12 * torch.tensor([2.0, 2.0, 1.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(grad[0], row0, rtol=1e-12, atol=1e-14)
    assert float(grad[1:].abs().max()) == 0.0
    assert float(metrics["gtpo_conflict_frac"]) == pytest.approx(6 / 11)
    assert float(metrics["gtpo_entropy_filtered_frac"]) == pytest.approx(1 / 3)


def gtpo_reference(logp, old, adv, mask, entropy, ids, groups, w=2.0, threshold=0.7, scale=0.1):
    """GTPO by its definition, with python loops: conflicts by (group, position, token) from the start and from the
    end, `delta`, the entropy guard and `(1/B) sum_i (1/n_i) sum_t -A' delta exp(lp - sg(lp)) / max(1, c_i)`."""
    b, k = mask.shape
    n = mask.sum(-1).tolist()
    seqs = [[int(ids[i, t]) for t in range(k) if mask[i, t]] for i in range(b)]
    active = [float(adv[i]) != 0 for i in range(b)]
    total = 0.0
    for i in range(b):
        if not n[i]:
            continue
        lead, trail = [False] * n[i], [False] * n[i]
        if active[i]:
            for run, from_end in ((lead, False), (trail, True)):
                for pos in range(n[i]):  # position counted from the start (or from the end)
                    t = n[i] - 1 - pos if from_end else pos
                    found = {1: False, -1: False}
                    for j in range(b):
                        at = n[j] - 1 - pos if from_end else pos
                        sign = 1 if float(adv[j]) > 0 else -1 if float(adv[j]) < 0 else 0
                        if sign and groups[j] == groups[i] and 0 <= at < n[j] and seqs[j][at] == seqs[i][t]:
                            found[sign] = True
                    if not (found[1] and found[-1]):
                        break
                    run[t] = True
        weight = w if float(adv[i]) > 0 else 0.0
        delta = [(weight if lead[t] else 1.0) * (weight if trail[t] else 1.0) for t in range(n[i])]
        c = max(1, sum(a or z for a, z in zip(lead, trail)))
        h = float(entropy[i][mask[i]].mean())
        shaped = float(adv[i]) - scale * h if h <= threshold else 0.0
        lp = logp[i][mask[i]]
        onpolicy = torch.exp(lp - lp.detach())
        total = total + (-shaped * torch.tensor(delta, dtype=lp.dtype) * onpolicy).sum() / n[i] / c
    return total / sum(1 for m in n if m)


def test_gtpo_matches_its_definition_on_random_groups():
    g = torch.Generator().manual_seed(0)
    logp, old, _, mask, group, entropy = ragged(6, groups=(4, 4))
    ids = torch.randint(0, 3, mask.shape, generator=g)  # 3 token ids: many shared tokens
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.5], (4, 4))
    loss, grad, metrics = grad_of("gtpo", logp, old, adv, mask, entropy=entropy * 1.2, group=group, token_ids=ids)
    assert float(metrics["gtpo_conflict_frac"]) > 0.2 and float(metrics["gtpo_entropy_filtered_frac"]) > 0
    x = logp.clone().requires_grad_(True)
    expected = gtpo_reference(x, old, adv, mask, entropy * 1.2, ids, group[:, 0].tolist())
    (expected_grad,) = torch.autograd.grad(expected, x)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, torch.where(mask, expected_grad, 0.0), rtol=1e-12, atol=1e-14)
    assert float(grad.abs().sum()) > 0


def test_gtpo_without_conflicts_or_entropy_guard_is_grpo_at_the_old_weights():
    logp, old, _, mask, group, entropy = ragged(7)
    ids = torch.arange(mask.numel()).reshape(mask.shape)  # every token distinct: no conflicts
    adv = group_advantages([1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.0], (3, 4))
    kw = {"entropy": entropy, "group": group, "token_ids": ids, "ent_scale": 0.0, "ent_threshold": math.inf}
    loss, grad, _ = grad_of("gtpo", old, old, adv, mask, **kw)
    grpo_loss, grpo_grad, _ = grad_of("grpo", old, old, adv, mask)
    torch.testing.assert_close(loss, grpo_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, grpo_grad, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# ST-PPO
# ----------------------------------------------------------------------------------------------


def test_st_ppo_hand_computed_with_one_token_turns():
    # S-PPO (one token per turn): ratios row 0 (A = +1) [1.5, 1.1], row 1 (A = -1) [0.5, 0.9], eps 0.2
    # PPO values: max(-1.5, -1.2) = -1.2 (clipped), -1.1; max(0.5, 0.8) = 0.8 (clipped), 0.9: token mean -0.15
    # kept coefficients g = [0, -1.1, 0, 0.9], dropped d = [-1.5, 0, 0.5, 0]: ||g|| = sqrt(2.02) = 1.4212670,
    # ||d|| = sqrt(2.5) = 1.5811388, h = 1.4212670 / 3.0024058 = 0.4733760; L = -0.15 h = -0.0710064
    old = torch.full((2, 2), -1.0, dtype=torch.float64)
    logp = old + torch.tensor([[1.5, 1.1], [0.5, 0.9]], dtype=torch.float64).log()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    segments = torch.tensor([[0, 1], [0, 1]])
    loss, grad, metrics = grad_of("st_ppo", logp, old, adv, segment_ids=segments)
    h = math.sqrt(2.02) / (math.sqrt(2.02) + math.sqrt(2.5))
    assert float(metrics["st_ppo_scale"]) == pytest.approx(h, rel=1e-12)
    assert float(metrics["clip_bias_norm"]) == pytest.approx(math.sqrt(2.5), rel=1e-12)
    assert float(loss) == pytest.approx(-0.15 * h, rel=1e-12)
    expected = h * torch.tensor([[0.0, -1.1], [0.0, 0.9]], dtype=torch.float64) / 4  # token mean of -A r
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_st_ppo_without_clipping_is_turn_ppo():
    logp, old, _, mask, _, _ = ragged(8)
    logp = torch.where(mask, old + 0.02 * (logp - old), torch.nan)  # ratios within 1 +- 0.2
    segments = (torch.arange(6) // 2).expand(7, 6)
    adv = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss, grad, metrics = grad_of("st_ppo", logp, old, adv, mask, segment_ids=segments)
    turn_loss, turn_grad, _ = grad_of("turn_ppo", logp, old, adv, mask, segment_ids=segments)
    assert float(metrics["st_ppo_scale"]) == 1.0 and float(metrics["clip_bias_norm"]) == 0.0
    torch.testing.assert_close(loss, turn_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, turn_grad, rtol=0, atol=0)


def test_st_ppo_normaliser_ignores_the_advantage_scale_and_falls_with_clipping():
    logp, old, _, mask, _, _ = ragged(9)
    segments = torch.zeros(7, 6, dtype=torch.long)  # one turn per response: GSPO's ratio with PPO's clip
    adv = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    scales = []
    for spread in (0.5, 1.0, 2.0, 4.0):  # further from the old policy: more turns clipped
        far = torch.where(mask, old + spread * (logp - old), torch.nan)
        loss, grad, metrics = grad_of("st_ppo", far, old, adv, mask, segment_ids=segments)
        loss3, grad3, metrics3 = grad_of("st_ppo", far, old, 3 * adv, mask, segment_ids=segments)
        assert float(metrics3["st_ppo_scale"]) == pytest.approx(float(metrics["st_ppo_scale"]), rel=1e-12)
        torch.testing.assert_close(grad3, 3 * grad, rtol=1e-12, atol=1e-14)
        turn_loss, _, turn = grad_of("turn_ppo", far, old, adv, mask, segment_ids=segments)
        assert float(loss) == pytest.approx(float(metrics["st_ppo_scale"]) * float(turn_loss), rel=1e-12)
        scales.append((float(turn["clipfrac"]), float(metrics["st_ppo_scale"])))
    assert scales[-1][0] > scales[0][0] and scales[0][1] > scales[-1][1]  # more clipped turns, smaller scale


# ----------------------------------------------------------------------------------------------
# the registry and the text trainer
# ----------------------------------------------------------------------------------------------


def test_registered_with_their_inputs():
    assert set(get_objective("trpa").required) == {"group", "ref_logp"}
    assert set(get_objective("reg_grpo").required) == {"group"}
    assert set(get_objective("gtpo").required) == {"group", "token_ids"}
    assert get_objective("gtpo").inputs == ("entropy",) and get_objective("st_ppo").inputs == ("segment_ids",)
    for name in ("trpa", "reg_grpo", "gtpo", "st_ppo"):
        assert get_objective(name).batch_statistics
    with pytest.raises(ValueError, match="group"):
        compute_policy_loss("reg_grpo", torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2))


def _arith(name, tmp_path, **overrides):
    pytest.importorskip("transformers")
    from flowrl.trainers import build_trainer
    from tests.conftest import tiny_config

    settings = {"objective.name": name, "run.epochs": 3, "batch.inner_epochs": 2, **overrides}
    config = tiny_config("text", overrides=[f"{k}={json.dumps(v)}" for k, v in settings.items()])
    return build_trainer(config, output_dir=tmp_path)


@pytest.mark.parametrize("name", ["trpa", "reg_grpo", "gtpo", "st_ppo"])
def test_trains_a_few_epochs_on_arith_with_whole_groups(name, tmp_path):
    trainer = _arith(name, tmp_path)
    before = [p.detach().clone() for p in trainer.params]
    summary = trainer.train()
    assert summary["epochs"] == 3
    history = trainer.log.history
    assert all(math.isfinite(r["loss"]) for r in history if "loss" in r)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))
    assert trainer.algorithm.updates_groups == (name != "st_ppo")
    assert trainer.algorithm.needs_reference() == (name == "trpa")
    own = {"trpa": "trpa_pairs", "reg_grpo": "reg_grpo_mse", "gtpo": "gtpo_conflict_frac", "st_ppo": "st_ppo_scale"}
    assert any(own[name] in r for r in history)


@pytest.mark.parametrize("name", ["trpa", "reg_grpo", "gtpo"])
def test_micro_batches_split_whole_groups_without_changing_the_update(name, tmp_path):
    # 32 completions in 8 groups of 4, one optimizer step per epoch: micro-batches of 3 (groups cut across calls,
    # coupled through the scheduler's two-pass coefficients) and of 32 (one call) take the same step
    overrides = {"run.epochs": 1, "batch.inner_epochs": 1, "batch.mini_batch_size": 32, "kl.beta": 0.0}
    small = _arith(name, tmp_path / "small", **{**overrides, "batch.micro_batch_size": 3})
    large = _arith(name, tmp_path / "large", **{**overrides, "batch.micro_batch_size": 32})
    before = [p.detach().clone() for p in large.params]
    small.train()
    large.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, large.params))
    for a, b in zip(small.params, large.params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
