"""Clipped trust regions of the text literature: PPO's clip on the token ratio with bounds of their own.

BNPO is PPO-clip with a token mean; BAPO searches its bounds per batch for balanced positive contributions, DCPO
sets them from each token's prior probability, CE-GPPO keeps a bounded gradient where it clips, PSPO smooths the
ratio before clipping it and ASPO flips the weight of positive tokens with entropy-dependent bounds.

Each surrogate returns the per-element loss value `v` and `g = dv/dx` (`flowrl.core.objectives`); the test-suite
checks value and gradient against a direct autograd implementation of the published formula
(`tests/core/test_llm_objectives.py`). Batch statistics go through `flowrl.core.dist`, so with several processes
every process uses the statistic of the global batch.
"""

from __future__ import annotations

import math

import torch

from flowrl.core.dist import all_reduce_sum
from flowrl.core.objectives import Surrogate, _clip_between, gppo, ppo_clip, register_objective


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
    metrics = {
        "bapo_clip_low": low,
        "bapo_clip_high": high,
        "bapo_pos_frac": p[j] / total if total > 0 else torch.ones((), dtype=ratio.dtype),
    }
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


# ----------------------------------------------------------------------------------------------
# the registry (docs/objectives.md: the paper, defaults and the choices made for each)
# ----------------------------------------------------------------------------------------------

register_objective(
    "bnpo",
    ppo_clip,
    agg="token_mean",
    description="BNPO (trl): PPO-clip (eps 0.2) with token-mean over the local batch",
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
