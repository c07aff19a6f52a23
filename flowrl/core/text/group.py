"""Group objectives of the text literature: losses that compare the responses to one prompt.

`trpa`, `reg_grpo` and `gtpo` couple the rows of a group (pairs of preference levels, a regression of the group's
advantages, tokens that positive and negative responses share); `st_ppo` couples the whole batch through a
normaliser. Each surrogate returns the per-element value `v` and `g = dv/dx` (`x` the objective's log-ratio), as
every objective of `flowrl.core.objectives` does; the math runs in the caller's dtype (fp32 or fp64), without
autograd.

Group structure reaches the core the way the preference objectives take it (`flowrl.core.preference`): required
hyper-parameters that the trainer passes per element (the text trainer's `Terms.inputs`):

- `group` (`[B]` or `[B, K]` non-negative integer group ids: a row's prompt; the same id on every element of a
  row), used by `trpa`, `reg_grpo`, `gtpo`;
- `token_ids` (`[B, K]` integer ids of the trained tokens), used by `gtpo`;
- `ref_logp` (`[B, K]` log-probs of the frozen reference model, no gradient), used by `trpa`.

A group's rows must all be in the call (the text trainer updates whole groups, and each group is sampled by one
process); the normalisers over the batch (the pair and token counts, ST-PPO's norms) are summed over the
processes (`flowrl.core.dist`), so these are `batch_statistics` objectives. Rows without a valid element belong
to no group. The hand-computed values and invariants are in `tests/core/test_llm_group_objectives.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowrl.core.dist import all_reduce_sum
from flowrl.core.objectives import Surrogate, ppo_clip, register_objective
from flowrl.core.text.sequence import segment_log_ratio


# ----------------------------------------------------------------------------------------------
# group helpers
# ----------------------------------------------------------------------------------------------


def row_groups(group, mask: torch.Tensor) -> torch.Tensor:
    """`[B]` long: each row's group id (`group` is `[B]`, `[B, 1]` or `[B, K]` with one id per row), -1 for a
    row without a valid element (padding rows of a micro-batch)."""
    b = mask.shape[0]
    ids = torch.as_tensor(group, device=mask.device)
    ids = ids.round().long() if ids.is_floating_point() else ids.long()
    ids = ids.reshape(b, -1)  # [B, 1] or [B, K]
    if ids.shape[1] == 1:
        rows = ids[:, 0]  # [B]
    else:
        rows = torch.where(mask, ids, -1).amax(1)  # [B]; padding elements may hold anything
    if (rows[mask.any(1)] < 0).any():
        raise ValueError("group ids must be non-negative integers")
    return torch.where(mask.any(1), rows, -1)


def row_advantages(adv: torch.Tensor, fmask: torch.Tensor) -> torch.Tensor:
    """`[B]`: a row's advantage (`[B, 1]`), or the mean over its valid elements (`[B, K]` per-token advantages)."""
    if adv.shape[-1] == 1:
        return adv[:, 0]
    return (adv * fmask).sum(-1) / fmask.sum(-1).clamp_min(1.0)  # clamp: rows without valid elements


def _dense(groups: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`(index [B], count)`: the groups renumbered 0..count-1; rows of no group (-1) get index `count`."""
    valid = groups >= 0
    if not groups.numel():
        return groups.clone(), 0
    _, inverse = torch.unique(torch.where(valid, groups, groups.max().clamp_min(0) + 1), return_inverse=True)
    count = int(torch.unique(groups[valid]).numel())
    return torch.where(valid, inverse, count), count


def _group_sum(values: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """`[B]`: the sum of `values [B]` over each row's group (`index` from `_dense`; 0 for rows of no group)."""
    sums = torch.zeros(count + 1, dtype=values.dtype, device=values.device).index_add_(0, index, values)
    sums[count] = 0.0  # the no-group bucket
    return sums[index]


# ----------------------------------------------------------------------------------------------
# TRPA: pairwise preferences between a group's levels, plus a trust region to the old policy
# ----------------------------------------------------------------------------------------------


def trpa(
    ratio,
    adv,
    *,
    logp,
    log_ratio,
    mask,
    group,
    ref_logp,
    beta: float = 0.1,
    anisotropy: float = 2.5,
    tr_kl_coef: float = 1e-3,
):
    """TRPA: a logistic loss on every pair of a group's preference levels, plus a KL to the old policy
    (Su et al. 2025, arXiv:2504.04524 eq. 11 with KTPO's anisotropy; XueruiSu/Trust-Region-Preference-Approximation
    `core_algos.compute_pairwise_policy_loss` and `dp_actor.update_policy`).

    With `z_i = mean_t (log pi_theta - log pi_ref)` over response i's tokens, every pair (w, l) of one group whose
    levels differ (w better) gives `h = kappa beta (z_w - z_l)`, `kappa = anisotropy` when w is at the group's top
    level and 1 otherwise, and

        L = mean_pairs -log sigmoid(h) + tr_kl_coef * token_mean(exp(-x) + x - 1),

    the second term the official trust region: verl's `low_var_kl` (k3) of the token log-ratio `x` to the old
    policy, clamped to [-10, 10], coefficient `tr_kl_loss_coef` 1e-3. The levels are the group's distinct
    advantages (the same order as its rewards), higher is better; with binary rewards "the group's top level" is
    the code's level 1 (a correct answer). The official `main_TRPA.sh` defaults: beta 0.1, anisotropy 2.5.

    Choices where the code differs: the pair mean runs over the global mini-batch, not each micro-batch (the same
    number when they coincide, and independent of the micro-batch size); a batch without any pair trains the trust
    region alone (the code then falls back to `-log sigmoid(+-z)` by absolute level); with multi-level rewards
    `anisotropy` applies to the group's best level, not only to a globally top one.

    Shapes: `ratio`, `log_ratio`, `logp`, `mask`, `ref_logp` `[B, K]`; `adv` `[B, 1]` or `[B, K]`; `group` `[B]` or
    `[B, K]`. Default aggregation `token_mean` (the value below already holds the pair mean's normaliser).
    """
    dtype = ratio.dtype
    fmask = mask.to(dtype)  # [B, K]
    n = fmask.sum(-1)  # [B]
    ref = torch.where(mask, torch.as_tensor(ref_logp, device=ratio.device).to(dtype), 0.0)  # [B, K]
    # clamp: rows without valid tokens have z = 0 and belong to no group
    z = ((logp - ref) * fmask).sum(-1) / n.clamp_min(1.0)  # [B] length-normalised log-ratio to the reference
    a = row_advantages(adv, fmask)  # [B]
    groups = row_groups(group, mask)  # [B]
    same = (groups[:, None] == groups[None, :]) & (groups[:, None] >= 0)  # [B, B]
    wins = (same & (a[:, None] > a[None, :])).to(dtype)  # [B, B] row i's level is above row j's
    index, count = _dense(groups)
    top = torch.full((count + 1,), -torch.inf, dtype=dtype, device=a.device).scatter_reduce(0, index, a, "amax")
    kappa = torch.where(a >= top[index], anisotropy, 1.0).to(dtype)  # [B] as a winner
    h = kappa[:, None] * beta * (z[:, None] - z[None, :])  # [B, B] h of the pair (winner i, loser j)
    pair_loss = F.softplus(-h) * wins  # [B, B] -log sigmoid(h) of each pair
    # d(-log sigmoid(h))/dh = -sigmoid(-h); dh/dz_winner = kappa beta, dh/dz_loser = -kappa beta
    slope = torch.sigmoid(-h) * kappa[:, None] * beta * wins  # [B, B]
    dz = slope.sum(0) - slope.sum(1)  # [B] d(sum over pairs)/dz_i
    # the pair mean and the token mean over the global batch: clamp for a batch without pairs or tokens
    pairs, tokens = all_reduce_sum(torch.stack([wins.sum(), fmask.sum()])).clamp_min(1.0).unbind()
    share = 0.5 * (pair_loss.sum(1) + pair_loss.sum(0))  # [B] each pair's loss split between its two rows
    per_token = (tokens / pairs) / n.clamp_min(1.0)  # [B] token_mean of the row's tokens gives the pair mean
    value = (share * per_token)[:, None] * fmask  # [B, K]
    coef = (dz * per_token)[:, None] * fmask  # dz_i/dx_it = 1/n_i
    # the trust region: k3 = exp(-x) + x - 1 (verl low_var_kl of pi_theta to pi_old), clamped to [-10, 10]
    x = log_ratio
    k3 = torch.expm1(-x) + x  # [B, K]
    inside = (k3 <= 10.0).to(dtype)  # the clamp's upper bound binds: no gradient (k3 >= 0: the lower never)
    value = value + tr_kl_coef * k3.clamp_max(10.0) * fmask
    coef = coef + tr_kl_coef * (-torch.expm1(-x)) * inside * fmask  # d k3/dx = 1 - exp(-x)
    margin = (h * wins).sum() / wins.sum().clamp_min(1.0)
    metrics = {
        "trpa_pairs": pairs,
        "trpa_accuracy": ((h > 0).to(dtype) * wins).sum() / wins.sum().clamp_min(1.0),  # pairs ordered already
        "trpa_margin": margin / beta,
        "trpa_tr_kl": (k3 * fmask).sum() / fmask.sum().clamp_min(1.0),
    }
    return Surrogate(value, coef, None, None, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# Reg-GRPO: regress the group's advantages on its normalised log-ratios
# ----------------------------------------------------------------------------------------------


def reg_grpo(ratio, adv, *, log_ratio, mask, group, eps: float = 1e-4, seq_reduce: str = "sum"):
    """Reg-GRPO: predict each response's advantage from the policy and regress it (Park et al. 2025, DeepVideo-R1,
    arXiv:2506.07464 sec. 3.2 eq. 7-8, app. A.4).

    With `rho_i = log pi_theta(o_i | q) - log pi_old(o_i | q)` (the sequence log-ratio: `seq_reduce = "sum"`; `"mean"`
    divides by the length), the predicted advantage is the group-normalised log-ratio
    `A_theta_i = (rho_i - mean_g rho) / (std_g rho + eps)` and

        L = E_groups (1/G) sum_i (A_i - A_theta_i)^2,

    no clip and no min (the paper's KL regulariser is the trainer's `kl` section). `std` is the sample std, as the
    group advantages' default; `eps` guards the zero spread at the old weights, where every `rho` is 0: there, with
    z-scored advantages (a group's sum to 0), the gradient is GRPO's sequence-level REINFORCE gradient (`-A_i` per
    unit of `rho_i`, averaged over responses) times `2 / eps` (tested): the loss is scale-free in `rho`, so its
    gradient grows as the group's log-ratios shrink; `optim.max_grad_norm` bounds the step. The gradient through
    the std is exact; where the spread is 0 its term vanishes.

    Shapes: `ratio`, `log_ratio`, `mask` `[B, K]`; `adv` `[B, 1]` or `[B, K]`; `group` `[B]` or `[B, K]`. Default
    aggregation `seq_mean_token_sum`: each row's tokens carry `(A_i - A_theta_i)^2 / n_i`, so the loss is the mean
    over responses.
    """
    if seq_reduce not in ("sum", "mean"):
        raise ValueError(f"reg_grpo seq_reduce must be 'sum' or 'mean', got {seq_reduce!r}")
    if eps <= 0:
        raise ValueError(f"reg_grpo eps must be > 0, got {eps}")
    dtype = ratio.dtype
    fmask = mask.to(dtype)  # [B, K]
    n = fmask.sum(-1).clamp_min(1.0)  # [B]; clamp: rows without tokens (they belong to no group)
    rho = (log_ratio * fmask).sum(-1)  # [B]
    if seq_reduce == "mean":
        rho = rho / n
    a = row_advantages(adv, fmask)  # [B]
    groups = row_groups(group, mask)
    index, count = _dense(groups)
    member = (groups >= 0).to(dtype)  # [B]
    size = _group_sum(member, index, count)  # [B] G of the row's group
    d = (rho - _group_sum(rho * member, index, count) / size.clamp_min(1.0)) * member  # [B] rho - mean
    dof = (size - 1).clamp_min(1.0)  # clamp: a group of one has no spread (d = 0)
    sigma = (_group_sum(d * d, index, count) / dof).sqrt()  # [B] sample std
    s = sigma + eps
    e = (d / s - a) * member  # [B] A_theta - A
    e_mean = _group_sum(e, index, count) / size.clamp_min(1.0)
    cross = _group_sum(e * d, index, count)  # [B] sum_k e_k d_k
    # at sigma = 0 every d is 0 and d / sigma stays bounded, so the std's term tends to 0
    through_std = torch.where(sigma > 0, cross * d / (s * s * dof * sigma.clamp_min(1e-30)), 0.0)
    c = 2 * ((e - e_mean) / s - through_std) * member  # [B] d(sum_k e_k^2)/d rho_i
    c = torch.where(size > 1, c, 0.0)  # a group of one: A_theta = 0 whatever rho
    per_token = c / n if seq_reduce == "mean" else c  # d rho_i / dx_it: 1/n_i or 1
    value = (e * e / n)[:, None] * fmask  # [B, K] row i's tokens sum to e_i^2
    coef = per_token[:, None] * fmask
    rows = member.sum().clamp_min(1.0)
    metrics = {"reg_grpo_mse": (e * e).sum() / rows, "reg_grpo_rho_std": (sigma * member).sum() / rows}
    return Surrogate(value, coef, None, None, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# GTPO: conflict-aware token updates and an entropy guard
# ----------------------------------------------------------------------------------------------


def conflict_runs(
    token_ids, mask: torch.Tensor, groups: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(leading, trailing)` `[B, K]` bool: GTPO's conflict tokens of the active rows (`positive | negative`).

    A valid token of an active row conflicts when, in its group, some positive and some negative row hold the same
    token id at the same position: counted from the start (leading) or aligned at the responses' ends (trailing).
    Only the run of conflicts from the first (last) token counts: the shared prefix (suffix). Positions are ranks
    among a row's valid tokens (the column for right-padded rows)."""
    ids = torch.as_tensor(token_ids, device=mask.device).long()  # [B, K]
    b, k = mask.shape
    active = (positive | negative) & (groups >= 0)  # [B]
    index, _ = _dense(groups)
    rank = mask.long().cumsum(-1) - 1  # [B, K] position among the row's valid tokens
    rev = mask.long().sum(-1, keepdim=True) - 1 - rank  # [B, K] position from the end
    ids = torch.where(mask, ids, 0)
    width = int(ids.max()) + 1 if ids.numel() else 1
    runs = []
    for pos in (rank, rev):
        key = (index[:, None] * k + pos.clamp_min(0)) * width + ids  # [B, K] (group, position, token)
        usable = mask & active[:, None]
        in_pos = torch.isin(key, key[usable & positive[:, None]])
        in_neg = torch.isin(key, key[usable & negative[:, None]])
        raw = usable & in_pos & in_neg  # [B, K]
        # the run from the first valid token: masked columns neither extend nor break it
        through = torch.where(mask, raw, True)
        if pos is rev:
            through = through.flip(-1)
        run = torch.cumprod(through.long(), dim=-1).bool()
        runs.append((run.flip(-1) if pos is rev else run) & usable)
    return runs[0], runs[1]


def gtpo(
    ratio,
    adv,
    *,
    mask,
    entropy,
    group,
    token_ids,
    conflict_weight: float = 2.0,
    ent_threshold: float = 0.7,
    ent_scale: float = 0.1,
):
    """GTPO: conflict-aware token updates with an entropy guard (Simoni et al. 2025, arXiv:2508.03772;
    winstonsmith1897/GTPO `gtpo/gtpo_training.py`: `build_conflict_mask`, `gtpo_compute_loss`).

    Within a group, a token of a response with `A != 0` is a conflict token when a positive and a negative response
    hold the same token at the same position, in the run shared from the start or (aligned at the ends) from the
    end (`conflict_runs`). Its update weight `delta` is 0 in negative responses (their push-down would hit the
    positive ones) and `conflict_weight` W in positive ones, per run (a token in both runs: `delta` multiplies,
    as the code's forward and backward masks do); every other token has `delta = 1`. The entropy guard uses the
    response's mean token entropy `H_i` of the current policy: `A'_i = A_i - ent_scale H_i` if `H_i <= ent_threshold`,
    else 0 (conflicts are found from the signs of `A`, as the code does). Per response,

        l_i = (1/n_i) sum_t -A'_i delta_it exp(log pi - sg(log pi)) / max(1, c_i),

    `c_i` the response's conflict tokens (leading or trailing run): value `-A' delta / max(1, c)` and gradient the
    same per unit of `log pi` (no importance ratio: GTPO is on-policy; later inner epochs still take this gradient).
    No clip, no KL. Defaults are the code's (`ENT_THRESHOLD` 0.7, `ENT_SCALE` 0.1, `W_RAW` 2).

    Choices where the code differs: `c_i` counts the union of the two runs in aligned positions (the code ORs the
    trailing run in reversed order); responses are averaged (`seq_mean_token_mean`; the code sums them, a constant
    factor). Shapes: `ratio`, `mask`, `entropy`, `token_ids` `[B, K]`; `adv` `[B, 1]` or `[B, K]`; `group` `[B]` or
    `[B, K]`.
    """
    dtype = ratio.dtype
    fmask = mask.to(dtype)  # [B, K]
    n = fmask.sum(-1).clamp_min(1.0)  # [B]; clamp: rows without tokens
    a = row_advantages(adv, fmask)  # [B]
    groups = row_groups(group, mask)
    positive, negative = a > 0, a < 0  # [B]
    leading, trailing = conflict_runs(token_ids, mask, groups, positive, negative)  # [B, K]
    weight = torch.where(positive, conflict_weight, 0.0).to(dtype)[:, None]  # [B, 1] a conflict's delta
    delta = torch.where(leading, weight, 1.0) * torch.where(trailing, weight, 1.0) * fmask  # [B, K]
    conflicts = ((leading | trailing) & mask).to(dtype).sum(-1)  # [B]
    mean_entropy = (entropy * fmask).sum(-1) / n  # [B]
    shaped = torch.where(mean_entropy <= ent_threshold, a - ent_scale * mean_entropy, 0.0)  # [B]
    coef = -(shaped / conflicts.clamp_min(1.0))[:, None] * delta  # [B, K]
    valid_rows = (mask.any(-1)).to(dtype)
    rows = valid_rows.sum().clamp_min(1.0)
    metrics = {
        "gtpo_conflict_frac": (conflicts.sum() / fmask.sum().clamp_min(1.0)),
        "gtpo_entropy_filtered_frac": ((mean_entropy > ent_threshold).to(dtype) * valid_rows).sum() / rows,
    }
    return Surrogate(coef.clone(), coef, None, None, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# ST-PPO: turn-level ratio and the clipping-bias normaliser
# ----------------------------------------------------------------------------------------------


def st_ppo(ratio, adv, *, mask, clip_eps_low: float = 0.2, clip_eps_high: float | None = None):
    """ST-PPO: PPO-clip on the turn (segment) ratio, scaled by a clipping-bias normaliser (Li et al. 2025,
    arXiv:2511.20718 v1 sec. 4, eq. 4 and 8; S-PPO / ST-PPO).

    Turn level (eq. 4, as `turn_ppo`): every token of a turn shares the turn's geometric-mean ratio
    `exp(mean_{t in turn} x_t)` (`segment_reduce` in the log-ratio estimator), with PPO's clip at `1 +- eps`.

    The clipping-bias correction is RECONSTRUCTED: the paper decomposes PPO's gradient and names the clipping-bias
    term `C(theta) = E[(1/|y|) sum_t 1{t clipped} w_t A_t grad log pi_t]`, the part of the importance-weighted
    gradient that the clip drops, and normalises the update by its L2 norm (eq. 7-8) so that updates dominated by
    clipped, highly off-policy tokens shrink; its exact normaliser could not be recovered (the v1 equations were not
    readable in any stored copy; v2 renames it "clipping-triggered normalisation"). flowrl has no per-parameter
    gradients inside the loss, so the norms are taken in the space of the per-token gradient coefficients (as if the
    score vectors `grad log pi_t` were orthonormal): with `g_t` the coefficients PPO keeps and `d_t = -A_t r_t` on the
    clipped tokens,

        L_ST = sg(h) L_PPO-turn,    h = ||g|| / (||g|| + ||d||)    (h = 1 when nothing is clipped or all is 0),

    both norms over the global batch. `h` is 1 when no token is clipped (the paper's PPO case), falls as the
    clipped share of the gradient grows, and does not change when the advantages are rescaled (tested).

    Shapes: `ratio`, `mask` `[B, K]`; `adv` `[B, 1]` or `[B, K]`. Default aggregation `token_mean`.
    """
    terms = ppo_clip(ratio, adv, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    fmask = mask.to(ratio.dtype)  # [B, K]
    clipped = (terms.clipped_high + terms.clipped_low) * fmask  # [B, K] 0/1, disjoint
    dropped = -adv * ratio * clipped  # [B, K] the coefficients the clip removes
    kept = terms.coef * fmask  # [B, K]
    squares = all_reduce_sum(torch.stack([(kept * kept).sum(), (dropped * dropped).sum()]))
    kept_norm, bias_norm = squares.sqrt().unbind()
    total = kept_norm + bias_norm
    scale = torch.where(total > 0, kept_norm / total.clamp_min(1e-30), 1.0)  # clamp: 0/0 is the no-gradient case
    metrics = {"st_ppo_scale": scale, "clip_bias_norm": bias_norm}
    return terms._replace(value=terms.value * scale, coef=terms.coef * scale, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# the registry (docs/objectives.md and docs/llm.md: the papers, defaults and choices)
# ----------------------------------------------------------------------------------------------

GROUP_INPUTS = ("group", "token_ids", "ref_logp")
"""Per-element tensors a trainer passes as required hyper-parameters (see the module docstring)."""

register_objective(
    "trpa",
    trpa,
    agg="token_mean",
    batch_statistics=True,
    description="TRPA: -log sigmoid over a group's preference-level pairs + k3 trust region (arXiv:2504.04524)",
)
register_objective(
    "reg_grpo",
    reg_grpo,
    agg="seq_mean_token_sum",
    batch_statistics=True,
    description="Reg-GRPO: regress advantages on group-normalised sequence log-ratios, no clip (arXiv:2506.07464)",
)
register_objective(
    "gtpo",
    gtpo,
    agg="seq_mean_token_mean",
    batch_statistics=True,
    description="GTPO: conflict tokens masked (negative) / up-weighted (positive), entropy guard (arXiv:2508.03772)",
)
register_objective(
    "st_ppo",
    st_ppo,
    log_ratio=segment_log_ratio,
    agg="token_mean",
    batch_statistics=True,
    description="ST-PPO: turn-ratio PPO-clip scaled by a clipping-bias normaliser (reconstructed) (arXiv:2511.20718)",
)
