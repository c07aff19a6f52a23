"""Policy objectives over masked `[B, K]` log-probs: one core for image denoising steps and text tokens.

Every objective is a pair of pure tensor functions:

1. a **log-ratio estimator** `x[B, K]` (differentiable): the token/step ratio `logp - old_logp`, the GSPO
   sequence ratio, or the GRPO-Guard normalised ratio;
2. a **surrogate** that, given `r = exp(x)` and the advantages, returns the per-element loss value `v` and
   its derivative `g = dv/dx` (the "value / gradient-weight" form, `reference/algorithms-llm.md` sec. 4.1).

`compute_policy_loss` (`flowrl.core.policy_loss`, re-exported here) assembles `l = v + g * (x - sg(x))`, which
has value `v` and gradient `g * grad(x)` exactly, so the trust-region logic runs once, without autograd, in fp32,
and is the same code for every modality. The registry (`register_objective`, `Objective`, `Surrogate`) is
`flowrl.core.objective_registry`, re-exported here too. Each surrogate's docstring gives the published loss; the
test-suite checks value and gradient against a direct autograd implementation of that formula.
"""

from __future__ import annotations

import torch

from flowrl.core.masking import greater, less
from flowrl.core.objective_registry import (  # noqa: F401  (re-exported: the objectives' public names)
    COMMON_HPARAMS,
    DIAGNOSTICS,
    EXTRA_INPUTS,
    INPUTS,
    OBJECTIVES,
    PER_STEP_METRICS_MAX_K,
    RENAMED_HPARAMS,
    LogRatio,
    Objective,
    Surrogate,
    element_log_ratio,
    get_objective,
    list_objectives,
    register_objective,
    uses_batch_statistics,
)
from flowrl.core.policy_loss import ENTROPY_TIE, compute_policy_loss, top_entropy_mask  # noqa: F401  (re-exported)
from flowrl.core.ratios import grpo_guard_log_ratio, sequence_log_ratio


# ----------------------------------------------------------------------------------------------
# log-ratio estimators: (masked element log-ratio, mask) -> x[B, K], differentiable through logp
# ----------------------------------------------------------------------------------------------


def gspo_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO sequence log-ratio (geometric mean over the valid elements), broadcast to `[B, K]`."""
    return sequence_log_ratio(log_ratio, mask)


def guard_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, *, std, mean_diff_sq) -> torch.Tensor:
    """GRPO-Guard normalised per-step log-ratio `s * (l + ||dmu||^2 / (2 s^2))`."""
    dtype, device = log_ratio.dtype, log_ratio.device
    std = torch.as_tensor(std, dtype=dtype, device=device).expand_as(log_ratio)
    mean_diff_sq = torch.as_tensor(mean_diff_sq, device=device).to(dtype).expand_as(log_ratio)
    # untrained steps may be deterministic (std 0): give them std 1 so no 0/0 reaches the gradient
    std = torch.where(mask, std, 1.0)
    mean_diff_sq = torch.where(mask, mean_diff_sq, 0.0)
    return grpo_guard_log_ratio(log_ratio, std, mean_diff_sq)


# ----------------------------------------------------------------------------------------------
# surrogates: (ratio, adv) -> Surrogate(value, d value / d log_ratio, clipped_high, clipped_low)
# ----------------------------------------------------------------------------------------------


def _dual_clip(value, coef, adv, dual_clip_c):
    """Dual clip (Ye et al. 2020, arXiv:1912.09729): for A < 0, `l = min(l, -A * c)`, gradient 0 there."""
    if dual_clip_c is None:
        return value, coef, None
    if dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    capped = (adv < 0) & (value > -adv * dual_clip_c)  # [B, K]
    value = torch.where(capped, -adv * dual_clip_c, value)
    coef = torch.where(capped, 0.0, coef)
    return value, coef, capped


def _bounds(clip_eps_low: float, clip_eps_high: float | None) -> tuple[float, float]:
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if clip_eps_low < 0 or high < 0:
        raise ValueError(f"clip ranges must be >= 0, got clip_eps_low={clip_eps_low}, clip_eps_high={high}")
    return 1.0 - clip_eps_low, 1.0 + high


def _clip_between(ratio, adv, low, high, dual_clip_c=None) -> Surrogate:
    """PPO-clip with absolute bounds `low < 1 < high` (scalars or `[B, K]` tensors) and an optional dual clip."""
    unclipped = -adv * ratio  # [B, K]
    # a bound binds where the clipped branch is strictly the max: A > 0 above 1+eps_h, A < 0 below 1-eps_l
    # (at the bound itself the branches tie and the gradient is kept, as autograd does); float 0/1 flags
    clipped_high = greater(ratio, high) * greater(adv, 0.0)  # [B, K]
    clipped_low = less(ratio, low) * less(adv, 0.0)  # [B, K]
    # max(-A r, -A clip(r)) is the clipped branch exactly where a bound binds, the unclipped one elsewhere
    value = torch.maximum(unclipped, -adv * ratio.clamp(low, high))
    coef = unclipped * (1 - (clipped_high + clipped_low))  # dl/dlog r = -A r on the unclipped branch, else 0
    value, coef, dual = _dual_clip(value, coef, adv, dual_clip_c)
    return Surrogate(value, coef, clipped_high, clipped_low, dual)


def ppo_clip(ratio, adv, *, clip_eps_low: float = 0.2, clip_eps_high: float | None = None, dual_clip_c=None):
    """PPO-clip, asymmetric bounds, optional dual clip (Schulman et al. 2017, arXiv:1707.06347 eq. 7).

    `l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`; `clip_eps_high` defaults to `clip_eps_low`
    (clip-higher: DAPO, arXiv:2503.14476 sec. 3.1); with `dual_clip_c` = c, `l = min(l, -A c)` for A < 0.
    Gradient `dl/dlog r = -A r` where the unclipped branch is active, 0 where a bound binds.
    """
    return _clip_between(ratio, adv, *_bounds(clip_eps_low, clip_eps_high), dual_clip_c)


def gppo(
    ratio,
    adv,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = 0.28,
    beta_low: float = 1.0,
    beta_high: float = 1.0,
    dual_clip_c=None,
):
    """Gradient-preserving clip: PPO's value, bounded gradient when clipped (GPPO arXiv:2508.07629, CE-GPPO).

    `l = max(-A r, -A clip(r, (1-eps_l) r/sg(r), (1+eps_h) r/sg(r)))`; in the two clipped regions the
    value is `-beta_l (1-eps_l) A` (A<0, r<1-eps_l) or `-beta_h (1+eps_h) A` (A>0, r>1+eps_h) and the
    gradient is that same number (CE-GPPO, arXiv:2509.20712). With beta = 1 the value equals
    clip-higher PPO on every input; elsewhere the gradient equals PPO's.
    """
    low, high = _bounds(clip_eps_low, clip_eps_high)
    unclipped = -adv * ratio  # [B, K]
    clipped_high = (adv > 0) & (ratio > high)
    clipped_low = (adv < 0) & (ratio < low)
    preserved_high = -beta_high * high * adv  # value and d/dlog r of -beta_h (1+eps_h) A r/sg(r)
    preserved_low = -beta_low * low * adv
    value = torch.where(clipped_high, preserved_high, torch.where(clipped_low, preserved_low, unclipped))
    coef = value.clone()  # in every region the value is linear in r / sg(r), so d/dlog r = value
    value, coef, dual = _dual_clip(value, coef, adv, dual_clip_c)
    return Surrogate(value, coef, clipped_high, clipped_low, dual)


def clamp(ratio, adv, *, clip_eps_low: float = 1e-4, clip_eps_high: float | None = None):
    """Clamp-only ratio (DPOK arXiv:2305.16381 as released; FIND arXiv:2407.19453): `l = -A clamp(r, 1-eps, 1+eps)`.

    Stricter than PPO: the gradient `-A r` flows only while `1-eps_low < r < 1+eps_high`, for both signs of A.
    `clip_eps_high` defaults to `clip_eps_low` (DPOK and FIND clamp symmetrically: 1e-4 and 0.2).
    """
    low, high = _bounds(clip_eps_low, clip_eps_high)
    value = -adv * ratio.clamp(low, high)  # [B, K]
    above, below = ratio > high, ratio < low
    coef = torch.where(above | below, 0.0, -adv * ratio)
    return Surrogate(value, coef, above, below)


def reinforce(ratio, adv):
    """Unclipped importance-weighted policy gradient `l = -A r` (REINFORCE / A2C as PPO, arXiv:2205.09123).

    At `r = 1` (one update per rollout) the gradient is exactly `-A grad(log pi)`.
    """
    value = -adv * ratio  # [B, K]
    return Surrogate(value, value, None, None)


def spo(ratio, adv, *, clip_eps_low: float = 0.2):
    """Quadratic-penalty surrogate (SPO, Xie et al. 2025, arXiv:2401.16025).

    `l = -(A r - |A| (r - 1)^2 / (2 eps))`, maximised at `r* = 1 + sign(A) eps` (`eps` = `clip_eps_low`, the trust
    region's width, flowrl's one name for it); the gradient `dl/dlog r = (-A + |A| (r - 1) / eps) r` is never
    zeroed, it pulls r back inside the trust region.
    """
    eps = clip_eps_low
    if eps <= 0:
        raise ValueError(f"clip_eps_low must be > 0, got {eps}")
    value = -(adv * ratio - adv.abs() * (ratio - 1) ** 2 / (2 * eps))  # [B, K]
    coef = (-adv + adv.abs() * (ratio - 1) / eps) * ratio
    # report where PPO's bound would bind, for comparability of the clip-fraction metric
    beyond_high, beyond_low = (adv > 0) & (ratio > 1 + eps), (adv < 0) & (ratio < 1 - eps)
    return Surrogate(value, coef, beyond_high, beyond_low)


def ppo_spo(ratio, adv, *, clip_eps_low: float = 0.2):
    """Asymmetric trust region of FPO++ ("ASPO", Yi et al. 2026, arXiv:2602.02481 eq. 11-12).

    PPO-clip where `A >= 0`; SPO's penalty `l = -(A r - |A| (r - 1)^2 / (2 eps))` where `A < 0`, with the same
    `eps` on both sides: a negative advantage pulls the ratio back toward 1 instead of pushing the flow's
    likelihood of a bad action down without bound.
    """
    pos = (adv >= 0).expand_as(ratio)  # [B, K]
    clipped, penalised = ppo_clip(ratio, adv, clip_eps_low=clip_eps_low), spo(ratio, adv, clip_eps_low=clip_eps_low)
    value = torch.where(pos, clipped.value, penalised.value)
    coef = torch.where(pos, clipped.coef, penalised.coef)
    return Surrogate(value, coef, pos & clipped.clipped_high.bool(), ~pos & penalised.clipped_low)


def sapo(ratio, adv, *, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """Soft adaptive gate instead of a clip (SAPO, arXiv:2511.20347).

    `l = -A (4/tau) sigmoid(tau (r - 1))` with `tau = tau_pos` for A > 0 and `tau_neg` otherwise;
    gradient `dl/dlog r = -A 4 sigma (1 - sigma) r`, which equals `-A` at r = 1 and decays smoothly.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    tau = torch.full_like(adv, tau_neg).masked_fill_(adv > 0, tau_pos)  # adv's shape: [B, 1] or [B, K]
    gate = torch.addcmul(-tau, tau, ratio).sigmoid_()  # [B, K] sigmoid(tau (r - 1)), one pass and one buffer
    scale = adv * -4.0  # -4 A
    value = gate * (scale / tau)
    coef = torch.addcmul(gate, gate, gate, value=-1.0).mul_(ratio).mul_(scale)  # -4 A sigma (1 - sigma) r
    return Surrogate(value, coef, None, None)


def cispo(ratio, adv, *, logp, clip_eps_low: float | None = None, clip_eps_high: float = 4.0):
    """Clipped IS-weight REINFORCE (CISPO, MiniMax-M1, arXiv:2506.13585 sec. 3.1).

    `l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta`: the truncated weight is a constant, so
    clipped elements still get gradient `-A w`. `clip_eps_high` means `1 + eps` (verl's convention; trl's
    `epsilon_high` is the absolute cap `1 + eps`); the default cap 5 is the one trl's docs recommend
    (ScaleRL, arXiv:2510.13786). No lower bound unless `clip_eps_low` is given. The value depends on
    `log pi_theta` itself, not only on the ratio.
    """
    low = 0.0 if clip_eps_low is None else 1.0 - clip_eps_low
    high = 1.0 + clip_eps_high
    weight = ratio.clamp(low, high)  # [B, K]
    coef = -adv * weight  # dl/dlogp = -A w: the weight is a constant
    value = coef * logp  # -sg(w) A log pi_theta
    return Surrogate(value, coef, greater(ratio, high), None if clip_eps_low is None else less(ratio, low))


# ----------------------------------------------------------------------------------------------
# the registry: presets pin the published defaults
# ----------------------------------------------------------------------------------------------

IMAGE_SCALE = 5e-4
"""Trust-region scale of image policies: Flow-GRPO's clip range 1e-4 for SD3.5 at 512 px (element-mean log-probs
over 65,536 latent elements) over PPO's 0.2 for tokens. Image defaults multiply widths by it and divide
temperatures by it. Other latent sizes move a range by `flowrl.core.ratios.clip_for_latent_size` (`sqrt(65536 / D)`):
the digits world (64 pixels) by 32x; its Flow-GRPO-family recipes clip at 1e-3 (10x, tuned), GRPO-Guard's at the
rule's 6.4e-5."""

_IMAGE_CLIP = 0.2 * IMAGE_SCALE  # 1e-4

register_objective("ppo", ppo_clip, agg="token_mean", image={"clip_eps_low": _IMAGE_CLIP})
register_objective(
    "grpo",
    ppo_clip,
    agg="seq_mean_token_mean",
    description="GRPO: PPO-clip (eps 0.2) averaged per sequence then over sequences (arXiv:2402.03300 eq. 3)",
    image={"clip_eps_low": _IMAGE_CLIP},
)
register_objective(
    "dapo",
    ppo_clip,
    agg="token_mean",
    clip_eps_high=0.28,
    description="DAPO: clip-higher PPO (eps 0.2 / 0.28) with token-mean aggregation (arXiv:2503.14476 sec. 3.1, 3.3)",
    image={"clip_eps_low": _IMAGE_CLIP, "clip_eps_high": 0.28 * IMAGE_SCALE},
)
register_objective(
    "dr_grpo",
    ppo_clip,
    agg="seq_mean_token_sum_norm",
    description="Dr.GRPO: PPO-clip summed per sequence over a constant length L (arXiv:2503.20783 sec. 3)",
    image={"clip_eps_low": _IMAGE_CLIP},
)
register_objective(
    "gspo",
    ppo_clip,
    log_ratio=gspo_log_ratio,
    elementwise=False,
    agg="seq_mean_token_mean",
    clip_eps_low=3e-4,
    clip_eps_high=4e-4,
    description="GSPO: PPO-clip on the sequence geometric-mean ratio (images: over trained steps) (arXiv:2507.18071)",
    # an image trajectory's log-ratio is the mean of ~10 per-step log-ratios with independent noise: its spread is
    # about 1/3 of a step's, so a third of the per-step image clip, with GSPO's 3:4 asymmetry
    image={"clip_eps_low": 3e-5, "clip_eps_high": 4e-5},
)
register_objective(
    "sapo", sapo, agg="seq_mean_token_mean", image={"tau_pos": 1.0 / IMAGE_SCALE, "tau_neg": 1.05 / IMAGE_SCALE}
)
register_objective("cispo", cispo, agg="token_mean", image={"clip_eps_high": 4.0 * IMAGE_SCALE})
register_objective("spo", spo, agg="token_mean", image={"clip_eps_low": 0.2 * IMAGE_SCALE})
register_objective(
    "gppo", gppo, agg="token_mean", image={"clip_eps_low": _IMAGE_CLIP, "clip_eps_high": 0.28 * IMAGE_SCALE}
)
register_objective("ppo_spo", ppo_spo, agg="token_mean", image={"clip_eps_low": _IMAGE_CLIP})
register_objective("clamp", clamp, agg="token_mean", image={"clip_eps_low": _IMAGE_CLIP})
register_objective("reinforce", reinforce, agg="token_mean")
register_objective(
    "grpo_guard",
    ppo_clip,
    log_ratio=guard_log_ratio,
    elementwise=True,
    agg="token_mean",
    clip_eps_low=2e-6,
    description="GRPO-Guard: PPO-clip (eps 2e-6) on the RatioNorm-ed per-step log-ratio (arXiv:2510.22319 sec. 3)",
    image={"clip_eps_low": 2e-6},
)
