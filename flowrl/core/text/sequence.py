"""Sequence- and segment-level ratios of the text literature: the ratio of a whole response or of a part of it.

GMPO and LUSPO clip the sequence's geometric-mean ratio, DHPO mixes the token and sequence ratios, Turn-PPO / ST-PPO
and SSPO share one ratio over each segment (turn, sentence: `segment_log_ratio`, `segment_mean`), MinPRO weights each
token by the smallest ratio of its prefix and VESPO by a kernel of the sequence's product ratio.

They were published for tokens; nothing in them is text-specific, so they work on denoising steps and control
actions too (with image-scale trust regions set by the user). Each surrogate returns the per-element loss value
`v` and `g = dv/dx` with `x` the objective's log-ratio (`flowrl.core.objectives`); the test-suite checks value
and gradient against a direct autograd implementation of the published formula (`tests/core/test_llm_objectives.py`).
Where a paper left a choice open, the docstring says which one is implemented and `docs/objectives.md` says why.
Inputs beyond `(ratio, adv)` are named keyword parameters (`logp`, `old_logp`, `mask`, `entropy`, `segment_ids`,
`state`). The other families of text objectives are the other modules of `flowrl.core.text`.
"""

from __future__ import annotations

import math

import torch

from flowrl.core.objectives import Surrogate, gspo_log_ratio, ppo_clip, register_objective, sequence_log_ratio


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


def dhpo_log_ratio(log_ratio, mask, *, adv, clip_eps_token: float = 0.2, clip_eps_seq: float = 0.2, mix: float = 0.5):
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


def minpro(
    ratio, adv, *, mask, clip_eps_low: float = 0.2, clip_eps_high: float | None = None, cap_at_one: bool = False
):
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


def vespo(
    ratio,
    adv,
    *,
    logp,
    log_ratio,
    fmask,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
):
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
    "gmpo",
    exp_surrogate,
    log_ratio=gmpo_log_ratio,
    elementwise=False,
    agg="seq_mean_token_mean",
    description="GMPO: geometric mean of token ratios clipped in log space (eps 0.4) (arXiv:2507.20673)",
)
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
