"""TROLL: a KL trust-region projection of each next-token distribution instead of ratio clipping.

Becker, Freymuth, Thilges, Otto, Neumann 2025, "TROLL: Trust Regions improve Reinforcement Learning for Large
Language Models", arXiv:2510.03817, sec. 3; the projection is the discrete counterpart of the differentiable trust
region layers of Otto et al. 2021 (arXiv:2101.09207, KL projection and its regression loss, eq. 8-10 there).

Each token's next-token distribution is kept on a sparse **support**: the sampled token (column 0) and the behaviour
policy's top-k other tokens, plus one **tail** bucket holding the rest of the mass (`log(1 - sum_support p)`), so
new (`p`) and old (`q`) are proper distributions over `V + 1` categories. Where `KL(p || q) > eps` the new one is
projected onto the trust region,

    p~ = argmin_{KL(p~ || q) <= eps} KL(p~ || p)   =>   log p~ = lam log p + (1 - lam) log q - log Z(lam),

a geometric interpolation whose `lam in (0, 1)` (`1 / (1 + eta)` with `eta` the Lagrange multiplier) makes the
bound tight; inside the region `p~ = p`. `lam` is found by bisection (`KL(p~_lam || q)` grows monotonically in lam:
its derivative is `lam Var_{p~}(log p - log q)`) and differentiated implicitly, so gradients flow through the
projection as in a trust-region layer. The loss of a token with advantage A is the unclipped importance-weighted
surrogate on the projected ratio plus a regression that pulls the network's own distribution towards its
projection (so the policy that samples next time honours the region too):

    l = -A p~(a) / q(a)  +  alpha KL(sg(p~) || p).

At the behaviour weights `p = q`, nothing is projected and the regression's gradient is 0: the gradient is the plain
policy gradient `-A grad log p(a)` (`tests/core/test_troll.py`).

Reconstructed, not confirmed from the paper's text or code (neither could be read here; docs/objectives.md): the
projection's direction (the I-projection above, as in Otto et al.'s KL layer), the tail bucket that closes the
sparse support, the implicit gradient through `lam`, and the defaults `kl_bound = 0.05`, `alpha = 1`, `top_k = 8`
(the paper reports 5-10 kept tokens covering >99.999% of the mass). All math runs in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import math

import torch

from flowrl.core.objectives import LogRatio, register_objective, reinforce


TAIL_FLOOR = 1e-20
"""Smallest tail mass: a support that holds (numerically) all the mass gets a negligible, finite tail bucket."""
BISECTION_STEPS = 40
"""Bisection steps for `lam` in [0, 1]: 2^-40 ~ 1e-12, below fp32 resolution."""


def with_tail(support_logp: torch.Tensor) -> torch.Tensor:
    """`[..., V + 1]`: the support's log-probs and the tail bucket `log(1 - sum exp)` (floored at `TAIL_FLOOR`)."""
    mass = torch.logsumexp(support_logp, dim=-1, keepdim=True).exp()  # [..., 1]
    tail = torch.log((1 - mass).clamp_min(TAIL_FLOOR))  # rounding can push the support's mass past 1
    return torch.cat([support_logp, tail], dim=-1)


def interpolate(log_q: torch.Tensor, diff: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """`log p~_lam = log q + lam (log p - log q) - log Z`: the geometric interpolation, normalised."""
    logits = log_q + lam.unsqueeze(-1) * diff  # [..., V + 1]
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def kl_to(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """`KL(a || b) = sum a (log a - log b)` over the last axis."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def project(log_p: torch.Tensor, log_q: torch.Tensor, kl_bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log p~ [..., C], lam [...])`: the KL projection of `p` onto `{p~ : KL(p~ || q) <= kl_bound}`.

    `log_p` carries the gradient; `log_q` is a constant. `lam = 1` (no projection) where `p` is inside the region;
    elsewhere `KL(p~ || q) = kl_bound` and the gradient includes `d lam / d log p` (implicit function theorem on
    `f(lam, p) = KL(p~_lam || q) - eps = 0`: `d lam = -(df/dp) / (df/dlam)`, `df/dlam = lam Var_{p~}(log p - log q)`).
    """
    diff = log_p - log_q  # [..., C]
    with torch.no_grad():
        outside = kl_to(log_p, log_q) > kl_bound  # [...]
        low, high = torch.zeros_like(diff[..., 0]), torch.ones_like(diff[..., 0])
        for _ in range(BISECTION_STEPS):  # KL(p~_lam || q) increases with lam: keep KL(low) <= eps < KL(high)
            mid = 0.5 * (low + high)
            above = kl_to(interpolate(log_q, diff, mid), log_q) > kl_bound
            high, low = torch.where(above, mid, high), torch.where(above, low, mid)
        lam = torch.where(outside, 0.5 * (low + high), 1.0)  # [...]
        log_tilde = interpolate(log_q, diff, lam)
        centred = diff - (log_tilde.exp() * diff).sum(-1, keepdim=True)
        slope = lam * (log_tilde.exp() * centred.square()).sum(-1)  # df/dlam = lam Var_{p~}(diff)
    # lam's value, with gradient -(df/dp) / (df/dlam) where the bound is active (0 inside the region)
    f = kl_to(interpolate(log_q, diff, lam), log_q)  # [...], f(lam*, p) with the gradient of p at fixed lam
    step = (f - f.detach()) / slope.clamp_min(1e-12)
    lam = lam - torch.where(outside, step, torch.zeros_like(step))
    return interpolate(log_q, diff, lam), lam.detach()


def troll_log_ratio(
    log_ratio, mask, *, topk_logp, old_topk_logp, kl_bound: float = 0.05, alpha: float = 1.0, top_k: int = 8
):
    """TROLL's projected log-ratio `log p~(a) - log q(a)` `[B, K]`, with `alpha KL(sg(p~) || p)` as the penalty.

    Args:
        log_ratio, mask: the element log-ratio (unused: TROLL's ratio comes from the supports) and the mask `[B, K]`.
        topk_logp (`torch.Tensor`): `[B, K, V]` the current policy's log-probs of each token's support, column 0
            the sampled token (so `topk_logp[..., 0]` is the token's log-prob); carries the gradient.
        old_topk_logp (`torch.Tensor`): `[B, K, V]` the behaviour policy's log-probs of the same support.
        kl_bound (`float`): eps, the per-token bound on `KL(p~ || q)` (in nats).
        alpha (`float`): weight of the regression of `p` onto `sg(p~)`.
        top_k (`int`): the behaviour policy's top tokens a trainer keeps besides the sampled one (`V = top_k + 1`);
            the loss itself takes any support width.
    """
    if kl_bound <= 0 or alpha < 0 or top_k < 0:
        raise ValueError(f"troll needs kl_bound > 0, alpha >= 0, top_k >= 0; got {kl_bound}, {alpha}, {top_k}")
    valid = mask.unsqueeze(-1)  # [B, K, 1]
    uniform = -math.log(topk_logp.shape[-1] + 1)
    # padding gets the same harmless distribution under both policies (no projection, no penalty, finite)
    log_p = with_tail(torch.where(valid, topk_logp, uniform))  # [B, K, V + 1], with gradient
    log_q = with_tail(torch.where(valid, old_topk_logp, uniform))  # [B, K, V + 1]
    log_tilde, lam = project(log_p, log_q, kl_bound)  # [B, K, V + 1], [B, K]
    x = log_tilde[..., 0] - log_q[..., 0]  # [B, K]: log p~(a) - log q(a), a = column 0
    target = log_tilde.detach()
    penalty = alpha * kl_to(target, log_p)  # [B, K]: alpha KL(sg(p~) || p), gradient through p only
    fmask = mask.to(x.dtype)
    count = fmask.sum().clamp_min(1.0)
    with torch.no_grad():
        metrics = {
            "troll_projected_frac": ((lam < 1).to(x.dtype) * fmask).sum() / count,
            "troll_kl": (kl_to(log_p, log_q) * fmask).sum() / count,  # KL(p || q) before the projection
            "troll_regression": (penalty * fmask).sum() / count,
        }
    return LogRatio(x, penalty * fmask, metrics)


register_objective(
    "troll",
    reinforce,
    log_ratio=troll_log_ratio,
    elementwise=True,  # each token's loss reads its own distributions only
    agg="token_mean",
    description="TROLL: KL trust-region projection of each top-k next-token distribution, no clip (arXiv:2510.03817)",
)
