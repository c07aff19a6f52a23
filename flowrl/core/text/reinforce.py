"""REINFORCE on log-probs with an importance weight that is masked, truncated or regularised, instead of a clip.

`l = -A sg(w) log pi` (gradient `-A w`): DISPO masks the weight outside four decoupled bounds, DPPO drops a token once
its probability moved too far (total variation or Bernoulli KL), GPG is plain REINFORCE (`w = 1`) and DRO / OPMD adds
a k2 pull towards the behaviour policy.

Each surrogate returns the per-element loss value `v` and `g = dv/dx` (`flowrl.core.objectives`); the test-suite
checks value and gradient against a direct autograd implementation of the published formula
(`tests/core/test_llm_objectives.py`).
"""

from __future__ import annotations

import torch

from flowrl.core.objectives import Surrogate, register_objective


# ----------------------------------------------------------------------------------------------
# surrogates
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# the registry (docs/objectives.md: the paper, defaults and the choices made for each)
# ----------------------------------------------------------------------------------------------

register_objective("dispo", dispo, agg="token_mean")
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
