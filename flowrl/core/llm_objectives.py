"""Objectives from the text-RL literature, on the same `[B, K]` value / gradient-weight core.

They were published for tokens; nothing in them is text-specific, so they work on denoising steps and control
actions too (with image-scale trust regions set by the user). Each surrogate returns the per-element loss value
`v` and `g = dv/dx` with `x` the objective's log-ratio (`flowrl.core.objectives`); the test-suite checks value
and gradient against a direct autograd implementation of the published formula (`tests/core/test_llm_objectives.py`).
Where a paper left a choice open, the docstring says which one is implemented and `docs/objectives.md` says why.

Inputs beyond `(ratio, adv)` are named keyword parameters (`logp`, `old_logp`, `mask`, `entropy`,
`segment_ids`, `state`); batch statistics go through `flowrl.core.dist`, so with several processes every
process uses the statistic of the global batch. The objectives that read entropies or the log-prob/advantage
covariance are in `flowrl.core.llm_entropy_objectives`, the group objectives in `flowrl.core.llm_group_objectives`.
"""

from __future__ import annotations

import math

import torch

from flowrl.core.dist import all_reduce_sum
from flowrl.core.objectives import (
    Surrogate,
    _clip_between,
    gppo,
    gspo_log_ratio,
    ppo_clip,
    register_objective,
    sequence_log_ratio,
)


# ----------------------------------------------------------------------------------------------
# log-ratio estimators
# ----------------------------------------------------------------------------------------------


def segment_mean(values: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor, reduce: str = "mean"):
    """`[B, K]`: the mean (or sum) of `values` over each element's segment (same row, same id), differentiable.

    Segments need not be contiguous (ESPO's entropy groups); masked elements take no part and get 0.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"segment reduce must be 'mean' or 'sum', got {reduce!r}")
    b, k = values.shape
    ids = segment_ids.long().clamp_min(0)
    width = int(ids.max()) + 1 if ids.numel() else 1
    flat = (torch.arange(b, device=values.device)[:, None] * width + ids).reshape(-1)  # [B*K]
    fmask = mask.to(values.dtype)
    sums = torch.zeros(b * width, dtype=values.dtype, device=values.device).index_add(
        0, flat, (values * fmask).reshape(-1)
    )
    if reduce == "mean":
        counts = torch.zeros(b * width, dtype=values.dtype, device=values.device).index_add(0, flat, fmask.reshape(-1))
        sums = sums / counts.clamp_min(1.0)  # clamp: segments of padding only
    return sums[flat].reshape(b, k) * fmask


def segment_log_ratio(log_ratio, mask, *, segment_ids, segment_reduce: str = "mean"):
    """Segment-level log-ratio (Turn-PPO / ST-PPO arXiv:2511.20718, SSPO arXiv:2511.04256): the geometric mean
    (`mean`) or product (`sum`) of the token ratios of each element's segment, shared by its tokens."""
    return segment_mean(log_ratio, mask, segment_ids, segment_reduce)


def gmpo_log_ratio(log_ratio, mask, *, adv, clip_eps_low: float = 0.4):
    """GMPO (Zhao et al. 2025, arXiv:2507.20673 eq. 4): the sequence mean of token log-ratios clipped in log space
    on the advantage's side, `d~ = sgn(A) min(sgn(A) d, sgn(A) clip(d, -eps, eps))` (`eps` = `clip_eps_low`, in log
    units), broadcast to `[B, K]`."""
    sign = torch.where(adv >= 0, 1.0, -1.0).to(log_ratio.dtype).expand_as(log_ratio)
    clipped = log_ratio.clamp(-clip_eps_low, clip_eps_low)
    token = sign * torch.minimum(sign * log_ratio, sign * clipped)  # [B, K]; grad 0 where the clip binds
    return sequence_log_ratio(token, mask)


def exp_surrogate(ratio, adv):
    """`l = -A r` on an estimator's (already clipped) log-ratio: GMPO's and DHPO's outer objective."""
    value = -adv * ratio  # [B, K]
    return Surrogate(value, value, None, None)


def _sign_clip(x, sign, eps: float):
    """Pessimistic clip of a log-ratio on the advantage's side: `sgn(A) min(sgn(A) x, sgn(A) clip(x))` with the
    bounds `log(1 - eps), log(1 + eps)`; the gradient stops where the clip binds (PPO's one-sided clip)."""
    clipped = x.clamp(math.log1p(-eps) if eps < 1 else -math.inf, math.log1p(eps))
    return sign * torch.minimum(sign * x, sign * clipped)


def dhpo_log_ratio(log_ratio, mask, *, adv, clip_eps_token: float = 0.2, clip_eps_seq: float = 0.2,
                   mix: float = 0.5):  # fmt: skip
    """DHPO's mixed log-ratio (arXiv:2601.05607): `w clip(x_token) + (1 - w) clip(x_seq)`, each branch clipped
    pessimistically in its own trust region (`1 +- eps_tok` for the token ratio, `1 +- eps_seq` for the sequence's
    geometric mean), i.e. the geometric mix `clip(r)^w clip(s)^(1-w)`; `w = 1` is GRPO's token clip and `w = 0`
    GSPO's sequence clip."""
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must lie in [0, 1], got {mix}")
    sign = torch.where(adv >= 0, 1.0, -1.0).to(log_ratio.dtype).expand_as(log_ratio)
    token = _sign_clip(log_ratio, sign, clip_eps_token)
    seq = _sign_clip(sequence_log_ratio(log_ratio, mask), sign, clip_eps_seq)
    return mix * token + (1 - mix) * seq


# ----------------------------------------------------------------------------------------------
# surrogates
# ----------------------------------------------------------------------------------------------


def bapo(
    ratio,
    adv,
    *,
    mask,
    rho0: float = 0.5,
    clip_low_start: float = 0.6,
    clip_low_max: float = 0.9,
    clip_low_step: float = 0.05,
    clip_high_start: float = 1.2,
    clip_high_max: float = 3.0,
    clip_high_step: float = 0.1,
    dual_clip_c: float | None = 3.0,
    measure: str = "paper",
    eps: float = 1e-8,
):
    """BAPO: PPO-clip with bounds searched per batch for balanced positive contributions (arXiv:2510.18927 sec. 4).

    With the contribution of the tokens that still receive gradient, `P(c_high) = sum r A 1[A > 0, r <= c_high]`
    and `N(c_low) = sum r |A| 1[A < 0, r >= c_low]`, first raise `c_low` from `clip_low_start` by
    `clip_low_step` (dropping low-probability negatives) while `P / (P + N) < rho0` and `c_low < clip_low_max`,
    then `c_high` likewise. The loss is `max(-A r, -A clip(r, c_low, c_high))`, dual-clipped at `c` for A < 0.
    The sums are over the global batch (all processes), so every process trains with the same bounds.

    `measure: paper` (the default, and the shipped config's) is the paper's monotone measure above. `measure: code`
    is the authors' verl plugin (WooooDyy/BAPO `recipe/bapo/policy_loss.py`): every token counts with its clamped
    ratio, `P = sum_{A>0} min(r, c_high) A`, `N = sum_{A<0} max(r, c_low) |A|`, and the test is
    `P / (N + eps) >= rho0` (its example script: rho0 = 0.5, i.e. P / (P + N) >= 1/3). Raising `c_low` there
    raises N, so when the target is unmet `c_low` runs to `clip_low_max` (docs/llm.md).
    """
    if measure not in ("paper", "code"):
        raise ValueError(f"bapo measure must be 'paper' or 'code', got {measure!r}")
    lows = _grid(clip_low_start, clip_low_max, clip_low_step).to(ratio)  # [I]
    highs = _grid(clip_high_start, clip_high_max, clip_high_step).to(ratio)  # [J]
    a = adv.expand_as(ratio)
    pos, neg = (a > 0) & mask, (a < 0) & mask
    if measure == "paper":  # contributions of the tokens that keep their gradient
        weight = ratio * a.abs() * mask  # [B, K]
        p = ((ratio[None] <= highs[:, None, None]) & pos).to(ratio.dtype).mul(weight).sum((1, 2))  # [J]
        n = ((ratio[None] >= lows[:, None, None]) & neg).to(ratio.dtype).mul(weight).sum((1, 2))  # [I]
    else:  # every token with its clamped ratio
        absa = a.abs()
        p = (torch.minimum(ratio[None], highs[:, None, None]) * absa * pos).sum((1, 2))  # [J]
        n = (torch.maximum(ratio[None], lows[:, None, None]) * absa * neg).sum((1, 2))  # [I]
    sums = all_reduce_sum(torch.cat([p, n]))
    p, n = sums[: highs.numel()], sums[highs.numel() :]

    def balanced(pos_sum, neg_sum):  # the target is met; an empty batch (or no negatives) is balanced
        if measure == "code":
            return (neg_sum <= 0) | (pos_sum >= rho0 * (neg_sum + eps))
        total = pos_sum + neg_sum
        return (total <= 0) | (pos_sum >= rho0 * total)

    i = _first_true(balanced(p[0], n))
    j = _first_true(balanced(p, n[i]))
    low, high = lows[i], highs[j]
    terms = _clip_between(ratio, adv, low, high, dual_clip_c)
    total = p[j] + n[i]
    metrics = {"bapo_clip_low": low, "bapo_clip_high": high,
               "bapo_pos_frac": p[j] / total if total > 0 else torch.ones((), dtype=ratio.dtype)}  # fmt: skip
    return terms._replace(metrics=metrics)


def _grid(start: float, stop: float, step: float) -> torch.Tensor:
    """`start, start + step, ..., stop` computed from integer counts (no accumulated rounding)."""
    if step <= 0 or stop < start:
        raise ValueError(f"a bound search needs step > 0 and max >= start, got {start}, {stop}, {step}")
    count = int(math.floor((stop - start) / step + 1e-9)) + 1
    return torch.tensor([round(start + i * step, 12) for i in range(count)], dtype=torch.float64)


def _first_true(flags: torch.Tensor) -> int:
    """Index of the first True of a 1-D bool tensor, or the last index when none is."""
    hits = torch.nonzero(flags.reshape(-1))
    return int(hits[0]) if hits.numel() else flags.numel() - 1


def dcpo(
    ratio,
    adv,
    *,
    old_logp,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    max_ratio: float = 10.0,
    dual_clip_c: float | None = 10.0,
):
    """DCPO's dynamic clipping from the token's prior probability (Yang et al. 2025, arXiv:2509.02333 eq. 6-8).

    With `q = pi_old(token)`, the bounds satisfy `|r - 1| r q <= eps`: `r_low = 1/2 + 1/2 sqrt(max(1 - 4 eps_low
    / q, 0))`, `r_high = min(1/2 + 1/2 sqrt(1 + 4 eps_high / q), max_ratio)`, so rare tokens may move further.
    Then `l = max(-A r, -A clip(r, r_low, r_high))`, dual-clipped at `c` for A < 0 (the official script: 10).

    Defaults are the official script's (lime-RL/DCPO `recipe/dcpo/run_dcpo.sh` + `run_base.sh`: clip_ratio_low 0.2,
    clip_ratio_high 0.28, clip_ratio_c 10; the paper's table gives 0.16 / 0.2). Its `only-token-mean` aggregation is
    verl's masked token mean over a micro-batch (`core_algos.agg_loss`); flowrl's `token_mean` takes it over the
    global mini-batch, the same number when the micro-batch is the mini-batch and free of the micro-batch size.
    """
    q = old_logp.exp()  # [B, K]
    # clamp: padding and q -> 0 would divide by zero; r_high saturates at max_ratio there anyway
    q = q.clamp_min(1e-12)
    low = 0.5 + 0.5 * torch.sqrt((1 - 4 * clip_eps_low / q).clamp_min(0.0))
    high = (0.5 + 0.5 * torch.sqrt(1 + 4 * clip_eps_high / q)).clamp_max(max_ratio)
    return _clip_between(ratio, adv, low, high, dual_clip_c)


def pspo(ratio, adv, *, alpha: float = 0.1, clip_eps_low: float | None = None):
    """PSPO: probability smoothing before the ratio (Dwyer et al. 2025, arXiv:2509.21282 sec. 3).

    `pi~ = (1 - alpha) pi_theta + alpha pi_old`, so `r~ = (1 - alpha) r + alpha`; GR-PSPO's surrogate is the
    unclipped `l = -A r~` with gradient `-A (1 - alpha) r`: the trust region is soft and never zeroes a gradient.
    With `clip_eps_low`, PPO's clip is applied to `r~` instead (the composed variant).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    smooth = (1 - alpha) * ratio + alpha  # [B, K]
    if clip_eps_low is None:
        value = -adv * smooth
        return Surrogate(value, -adv * (1 - alpha) * ratio, None, None)
    terms = ppo_clip(smooth, adv, clip_eps_low=clip_eps_low)
    # d r~ / d log r = (1 - alpha) r, and ppo_clip's coef is -A r~ where unclipped
    coef = torch.where(terms.coef != 0, -adv * (1 - alpha) * ratio, 0.0)
    return terms._replace(coef=coef)


def aspo(
    ratio,
    adv,
    *,
    logp,
    mask,
    entropy,
    clip_eps_low: float = 0.2,
    clip_eps_high_entropy: float = 0.4,
    entropy_quantile: float = 0.8,
    max_weight_neg: float = 3.0,
    max_weight_pos: float = 3.0,
):
    """ASPO: asymmetric importance sampling, flipped weights for positive tokens (arXiv:2510.06062 sec. 4).

    A > 0: weight `1 / r~`, `r~ = min(r, 1 + eps)`, as `l = -A (r~ / sg(r~)) / sg(r~)` (value `-A / r~`, gradient
    `-A / r~` below the bound, 0 above); once `1 / r~ > max_weight_pos` the weight is capped and the gradient kept
    (`l = -A sg(c_pos) log pi`). A < 0: PPO's one-sided clip `r' = max(r, 1 - eps)`, `l = -A r'`, and above
    `max_weight_neg` the gradient-preserving dual clip `l = -A sg(c_neg) log pi`. `eps` is `clip_eps_low` for the
    tokens at or below the `entropy_quantile` of their response's entropies and `clip_eps_high_entropy` above
    (the official code's split; its mask names are swapped).
    """
    ent = torch.where(mask, entropy, torch.nan)
    cut = torch.nanquantile(ent, entropy_quantile, dim=-1, keepdim=True)  # [B, 1]; rows without tokens: nan
    eps = torch.where(entropy > cut, clip_eps_high_entropy, clip_eps_low).to(ratio.dtype)  # [B, K]
    a = adv.expand_as(ratio)
    # A > 0: flipped weight
    capped_r = torch.minimum(ratio, 1 + eps)
    inv = 1.0 / capped_r
    above = ratio > 1 + eps
    pos_value = torch.where(inv > max_weight_pos, -a * max_weight_pos * logp, -a * inv)
    pos_coef = torch.where(inv > max_weight_pos, -a * max_weight_pos, torch.where(above, 0.0, -a * inv))
    # A < 0: one-sided clip below, gradient-preserving dual clip above
    floored = torch.maximum(ratio, 1 - eps)
    below = ratio < 1 - eps
    neg_value = torch.where(floored > max_weight_neg, -a * max_weight_neg * logp, -a * floored)
    neg_coef = torch.where(floored > max_weight_neg, -a * max_weight_neg, torch.where(below, 0.0, -a * ratio))
    positive = a > 0
    value = torch.where(positive, pos_value, neg_value)
    coef = torch.where(positive, pos_coef, neg_coef)
    return Surrogate(value, coef, positive & above, ~positive & below & (a < 0))


def dispo(
    ratio,
    adv,
    *,
    logp,
    clip_eps_low_pos: float = 0.2,
    clip_eps_high_pos: float = 0.28,
    clip_eps_low_neg: float = 0.2,
    clip_eps_high_neg: float = 0.28,
):
    """DISPO: four decoupled bounds on a REINFORCE-style IS weight (arXiv:2602.00983).

    `l = -A sg(w) log pi` with `w = r` inside `[1 - eps_low^s, 1 + eps_high^s]` and `w = 0` outside (masked,
    not clamped: the paper's criticism of CISPO is that clamped weights still push outside the trust region), `s`
    the sign of A (correct vs incorrect responses). Gradient `-A w`.
    """
    a = adv.expand_as(ratio)
    positive = a > 0
    low = torch.where(positive, 1 - clip_eps_low_pos, 1 - clip_eps_low_neg).to(ratio.dtype)
    high = torch.where(positive, 1 + clip_eps_high_pos, 1 + clip_eps_high_neg).to(ratio.dtype)
    above, below = ratio > high, ratio < low
    weight = torch.where(above | below, 0.0, ratio)  # [B, K]
    coef = -a * weight
    return Surrogate(coef * logp, coef, above, below)


def minpro(ratio, adv, *, mask, clip_eps_low: float = 0.2, clip_eps_high: float | None = None,
           cap_at_one: bool = False):  # fmt: skip
    """MinPRO: the token loss weighted by the minimum ratio of the preceding prefix (arXiv:2601.22718).

    The correct off-policy weight of token t is the prefix product `prod_{j<t} r_j`; MinPRO replaces it by the
    stable `w_t = sg(min_{j<t} r_j)` over the valid tokens before t (1 for the first) and multiplies PPO-clip's
    token loss by it, so every token after a strongly down-weighted one is down-weighted too. `cap_at_one`
    also bounds the weight by 1.
    """
    terms = ppo_clip(ratio, adv, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    padded = torch.where(mask, ratio, torch.inf)  # padding never lowers the minimum
    prefix = torch.cummin(padded, dim=1).values  # [B, K] inclusive minimum
    weight = torch.cat([torch.ones_like(prefix[:, :1]), prefix[:, :-1]], dim=1)  # exclusive: min over j < t
    weight = torch.where(torch.isinf(weight), 1.0, weight)  # only padding before t: an empty prefix
    if cap_at_one:
        weight = weight.clamp_max(1.0)
    metrics = {"prefix_weight_mean": (weight * mask).sum() / mask.sum().clamp_min(1)}
    return terms._replace(value=terms.value * weight, coef=terms.coef * weight, metrics=metrics)


def dro(ratio, adv, *, logp, old_logp, beta: float = 1.0):
    """Regularised REINFORCE / OPMD (Yao et al. 2025, arXiv:2509.24203; verl's `dro`):
    `l = -(A log pi - beta/2 (log pi - log pi_old)^2)`, gradient `-A + beta log r`: a k2 pull towards pi_old."""
    log_ratio = logp - old_logp
    value = -adv * logp + 0.5 * beta * log_ratio**2
    coef = -adv + beta * log_ratio
    return Surrogate(value, coef.expand_as(value), None, None)


def gpg(ratio, adv, *, logp):
    """GPG / plain REINFORCE on log-probs (arXiv:2504.02546; verl's `gpg`): `l = -A log pi`, gradient `-A`."""
    value = -adv * logp
    return Surrogate(value, (-adv).expand_as(value), None, None)


def dppo_mask(
    ratio,
    adv,
    *,
    logp,
    old_logp,
    divergence: str = "tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    max_weight: float = 20.0,
):
    """DPPO's divergence-masked REINFORCE (arXiv:2602.04879; verl's `dppo_tv` / `dppo_kl`).

    `l = -A sg(min(r, max_weight)) log pi`, except that a token is dropped once its probability has moved too far
    in the advantage's direction: `tv`: `p - q > delta_high` (A > 0) or `q - p > delta_low` (A < 0), with
    `p = pi(token)`, `q = pi_old(token)`; `kl`: the Bernoulli KL `q log(q/p) + (1-q) log((1-q)/(1-p))` exceeds
    `delta` while p moved in the advantage's direction. Defaults: the authors' 0.15 (tv) and 0.05 (kl); verl's
    function default truncation 20.
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"divergence must be 'tv' or 'kl', got {divergence!r}")
    default = 0.15 if divergence == "tv" else 0.05
    low = default if delta_low is None else delta_low
    high = default if delta_high is None else delta_high
    a = adv.expand_as(ratio)
    p, q = logp.exp(), old_logp.exp()
    up, down = (a > 0) & (p > q), (a < 0) & (p < q)
    if divergence == "tv":
        gap = (p - q).abs()
    else:
        # clamp: probabilities of exactly 0 or 1 make the Bernoulli KL infinite
        pc, qc = p.clamp(1e-12, 1 - 1e-7), q.clamp(1e-12, 1 - 1e-7)
        gap = qc * (qc / pc).log() + (1 - qc) * ((1 - qc) / (1 - pc)).log()
    dropped_high, dropped_low = up & (gap > high), down & (gap > low)
    weight = torch.where(dropped_high | dropped_low, 0.0, ratio.clamp_max(max_weight))
    coef = -a * weight
    return Surrogate(coef * logp, coef, dropped_high, dropped_low)


def vespo(ratio, adv, *, logp, log_ratio, fmask, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0,
          lambda_neg: float = 2.0):  # fmt: skip
    """VESPO (Shen et al. 2026; trl's `vespo`): `l = -phi(w) A log pi` with `w` the sequence's product ratio
    `exp(sum_t log r_t)` and the detached Gamma-kernel weight `phi(w) = w^k exp(lambda (1 - w))` (`phi(1) = 1`),
    `(k, lambda) = (2, 3)` for A >= 0 and `(3, 2)` for A < 0. The gradient is `-phi A` on every token.

    Guards as trl's `get_gamma_weights`: each token's log-ratio clamped to [-20, 20] before the sum, log w to
    `[log 1e-8, 20]`, lambda >= 1e-4, and a non-finite phi set to 0 (the sample is then left out, not a NaN loss).
    """
    # [B, K]; one runaway token cannot overflow the sum (the core hands over log_ratio with padding zeroed)
    token = log_ratio.clamp(-20.0, 20.0)
    log_w = token.sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)  # [B, 1]
    w = log_w.exp()
    nonneg = adv >= 0  # [B, 1] or [B, K]
    k = torch.full_like(adv, k_neg).masked_fill_(nonneg, k_pos)
    lam = torch.full_like(adv, max(lambda_neg, 1e-4)).masked_fill_(nonneg, max(lambda_pos, 1e-4))
    phi = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # [B, 1] or [B, K]
    coef = adv * -phi  # [B, 1] (or [B, K]): broadcast over the row, no expanded copy
    if phi.shape[-1] == 1:  # one weight per sequence: each counted once per real token
        n = fmask.sum(-1, keepdim=True)  # [B, 1]
        weight_mean = torch.dot(phi.reshape(-1), n.reshape(-1)) / n.sum().clamp_min(1.0)
    else:
        weight_mean = (phi * fmask).sum() / fmask.sum().clamp_min(1.0)  # over real tokens only
    return Surrogate(coef * logp, coef, None, None, metrics={"vespo_weight_mean": weight_mean})


# ----------------------------------------------------------------------------------------------
# the registry (docs/objectives.md: the paper, defaults and the choices made for each)
# ----------------------------------------------------------------------------------------------

register_objective(
    "bnpo",
    ppo_clip,
    agg="token_mean",
    description="BNPO (trl): PPO-clip (eps 0.2) with token-mean over the local batch",
)
register_objective(
    "gmpo",
    exp_surrogate,
    log_ratio=gmpo_log_ratio,
    elementwise=False,
    agg="seq_mean_token_mean",
    description="GMPO: geometric mean of token ratios clipped in log space (eps 0.4) (arXiv:2507.20673)",
)
register_objective("bapo", bapo, agg="token_mean", batch_statistics=True)
register_objective("dcpo", dcpo, agg="token_mean")
register_objective(
    "ce_gppo",
    gppo,
    agg="token_mean",
    clip_eps_high=0.2,
    beta_low=0.5,
    beta_high=1.0,
    dual_clip_c=10.0,
    description="CE-GPPO: gradient-preserving clip, scaled negatives beta_1 0.5 (arXiv:2509.20712)",
)
register_objective("pspo", pspo, agg="token_mean")
register_objective("aspo", aspo, agg="token_mean", elementwise=False)
register_objective("dispo", dispo, agg="token_mean")
register_objective(
    "turn_ppo",
    ppo_clip,
    log_ratio=segment_log_ratio,
    elementwise=False,
    agg="token_mean",
    description="ST-PPO/Turn-PPO: PPO-clip on the segment (turn) geometric-mean ratio (arXiv:2511.20718)",
)
register_objective(
    "dhpo",
    exp_surrogate,
    log_ratio=dhpo_log_ratio,
    elementwise=False,
    agg="token_mean",
    description="DHPO: token and sequence ratios clipped per branch, geometric mix (arXiv:2601.05607)",
)
register_objective("minpro", minpro, agg="token_mean", elementwise=False)
register_objective(
    "dro",
    dro,
    agg="token_mean",
    description="DRO / OPMD: REINFORCE with a (log pi - log pi_old)^2 / 2 pull (arXiv:2509.24203; verl dro)",
)
register_objective("gpg", gpg, agg="token_mean")
register_objective(
    "dppo_tv",
    dppo_mask,
    agg="token_mean",
    divergence="tv",
    description="DPPO-TV: REINFORCE masked where |p - q| > 0.15 in the advantage's direction (arXiv:2602.04879)",
)
register_objective(
    "dppo_kl",
    dppo_mask,
    agg="token_mean",
    divergence="kl",
    description="DPPO-KL: REINFORCE masked where the Bernoulli KL > 0.05 (arXiv:2602.04879)",
)
register_objective(
    "vespo",
    vespo,
    agg="token_mean",
    elementwise=False,
    description="VESPO: REINFORCE weighted by a Gamma kernel of the sequence ratio (trl vespo)",
)
register_objective(
    "luspo",
    ppo_clip,
    log_ratio=gspo_log_ratio,
    elementwise=False,
    agg="seq_mean_token_sum",
    clip_eps_low=2e-3,
    clip_eps_high=2.5e-3,
    description="LUSPO: GSPO's sequence-ratio clip scaled by the response length (trl's luspo)",
)
