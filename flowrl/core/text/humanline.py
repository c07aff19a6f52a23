"""Humanline GRPO: the token log-ratio clamped asymmetrically before PPO's clip, with a k3 KL to the same anchor.

Liu et al. 2025, "Humanline: Online Alignment as Perceptual Loss", arXiv:2509.24207 sec. 4; the official code is
ContextualAI/HALOs (`humanline=true`: `BasicTrainer.get_ratios` and `GRPOTrainer.loss` in `train/trainers.py`,
defaults in `config/config.yaml` and `config/loss/grpo.yaml`). With `x = log pi_theta - log pi_ref` per token,

    r~ = exp(clamp(x, log eps_P, log eps_R))            (zero gradient where the clamp binds)
    l  = -min(A r~, A clip(r~, 1 - eps, 1 + eps)) + beta (exp(-x) + x - 1)

(the k3 term on the raw, unclamped `x`). The anchor `pi_ref` is the policy one optimizer step earlier: HALOs syncs
its reference to the policy after each backward and before the optimizer step, which the text trainer reproduces
with `sync_reference: true` (`flowrl.trainers.text.text`); with the default anchor (the behaviour policy) the same loss
is Humanline's clipping alone. HALOs' defaults: `log eps_P = -1`, `log eps_R = 1.5`, `eps = 0.01`, `beta = 0.01`;
its loss is a masked token mean over each micro-batch (flowrl's `token_mean`, over the mini-batch).
"""

from __future__ import annotations

import torch

from flowrl.core.objectives import Surrogate, _bounds, _clip_between, register_objective


def humanline(
    ratio,
    adv,
    *,
    mask,
    log_epsilon_p: float = -1.0,
    log_epsilon_r: float = 1.5,
    clip_eps_low: float = 0.01,
    clip_eps_high: float | None = None,
    beta: float = 0.01,
):
    """Humanline GRPO (arXiv:2509.24207; HALOs `humanline=true`): PPO-clip on the clamped ratio plus beta k3.

    `r~ = exp(clamp(log r, log_epsilon_p, log_epsilon_r))`, `l = max(-A r~, -A clip(r~, 1 - eps_l, 1 + eps_h))
    + beta (1/r + log r - 1)`; `dl/dlog r = -A r~` where neither the clamp nor the clip binds (0 where one does)
    `+ beta (1 - 1/r)`. The clamp's binding (where PPO's clip does not already bind) is reported as `clipfrac_dual`
    (it caps the loss like a dual clip: A < 0 above `exp(log_epsilon_r)`, A > 0 below `exp(log_epsilon_p)`).
    """
    if not log_epsilon_p < 0 < log_epsilon_r:
        raise ValueError(f"humanline needs log_epsilon_p < 0 < log_epsilon_r, got {log_epsilon_p}, {log_epsilon_r}")
    x = torch.log(ratio)  # [B, K]: the raw log-ratio (the core clamps it to +-20 first)
    inside = ((x >= log_epsilon_p) & (x <= log_epsilon_r)).to(ratio.dtype)  # clamp's gradient: 1 on the bounds
    clamped = torch.exp(x.clamp(log_epsilon_p, log_epsilon_r))  # [B, K]
    ppo = _clip_between(clamped, adv, *_bounds(clip_eps_low, clip_eps_high))
    inv = torch.reciprocal(ratio)  # exp(-x)
    value = ppo.value + beta * (inv + x - 1)  # k3 = exp(-x) + x - 1 on the raw log-ratio
    coef = ppo.coef * inside + beta * (1 - inv)
    clip_flags = ppo.clipped_high + ppo.clipped_low  # float 0/1, disjoint
    clamp_binds = (1 - inside) * (1 - clip_flags)
    fmask = mask.to(ratio.dtype)
    metrics = {"humanline_clamped_frac": ((1 - inside) * fmask).sum() / fmask.sum().clamp_min(1.0)}
    return Surrogate(value, coef, ppo.clipped_high, ppo.clipped_low, clamp_binds, metrics)


register_objective(
    "humanline",
    humanline,
    agg="token_mean",
    description="Humanline GRPO: log-ratio clamped to [-1, 1.5], PPO clip 0.01, k3 0.01 (arXiv:2509.24207; HALOs)",
)
