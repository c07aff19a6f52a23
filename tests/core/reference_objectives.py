"""Direct autograd implementations of the published objectives, written independently of flowrl.core.

Each returns the per-element loss `[B, K]` (gradients flow through torch's own autograd); `ref_aggregate`
reduces it with an explicit loop over rows. These are the parity targets for `compute_policy_loss`.
"""

from __future__ import annotations

import torch


def ref_aggregate(loss, mask, agg, norm_len=None):
    mask = mask.to(loss.dtype)
    rows = []
    for i in range(loss.shape[0]):
        n = mask[i].sum()
        if n == 0:
            continue
        rows.append(((loss[i] * mask[i]).sum(), n))
    if not rows:
        return loss.sum() * 0
    if agg == "token_mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    if agg == "seq_mean_token_mean":
        return sum(s / n for s, n in rows) / len(rows)
    if agg == "seq_mean_token_sum":
        return sum(s for s, _ in rows) / len(rows)
    if agg == "seq_mean_token_sum_norm":
        length = loss.shape[1] if norm_len is None else norm_len
        return sum(s for s, _ in rows) / (len(rows) * length)
    if agg == "sum":
        return sum(s for s, _ in rows)
    raise ValueError(agg)


def ref_ppo(logp, old_logp, adv, mask, *, clip_eps_low=0.2, clip_eps_high=None, dual_clip_c=None):
    """max(-A r, -A clip(r, 1-eps_l, 1+eps_h)), then min(., -A c) for A < 0."""
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - old_logp)
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high))
    if dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip_c), loss)
    return loss


def ref_gppo(logp, old_logp, adv, mask, *, clip_eps_low=0.2, clip_eps_high=0.28, beta_low=1.0, beta_high=1.0):
    """CE-GPPO piecewise form with r/sg(r); with beta = 1 it is GPPO's clip(r, (1-e) r/sg(r), (1+e) r/sg(r))."""
    ratio = torch.exp(logp - old_logp)
    unit = ratio / ratio.detach()  # value 1, gradient of r
    if beta_low == 1.0 and beta_high == 1.0:
        low, high = (1 - clip_eps_low) * unit, (1 + clip_eps_high) * unit
        clipped = torch.where(ratio < low, low, torch.where(ratio > high, high, ratio))
        return torch.maximum(-adv * ratio, -adv * clipped)
    low_region = (adv < 0) & (ratio < 1 - clip_eps_low)
    high_region = (adv > 0) & (ratio > 1 + clip_eps_high)
    return torch.where(
        low_region,
        -beta_low * (1 - clip_eps_low) * unit * adv,
        torch.where(high_region, -beta_high * (1 + clip_eps_high) * unit * adv, -ratio * adv),
    )


def ref_clamp(logp, old_logp, adv, mask, *, clip_eps_low=1e-4, clip_eps_high=None):
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    return -adv * torch.clamp(torch.exp(logp - old_logp), 1 - clip_eps_low, 1 + high)


def ref_reinforce(logp, old_logp, adv, mask):
    return -adv * torch.exp(logp - old_logp)


def ref_spo(logp, old_logp, adv, mask, *, clip_eps_low=0.2):
    eps = clip_eps_low
    ratio = torch.exp(logp - old_logp)
    return -(ratio * adv - adv.abs() / (2 * eps) * (ratio - 1) ** 2)


def ref_sapo(logp, old_logp, adv, mask, *, tau_pos=1.0, tau_neg=1.05):
    ratio = torch.exp(logp - old_logp)
    tau = torch.where(
        adv > 0, torch.as_tensor(tau_pos, dtype=ratio.dtype), torch.as_tensor(tau_neg, dtype=ratio.dtype)
    )
    return -adv * (4 / tau) * torch.sigmoid(tau * (ratio - 1))


def ref_cispo(logp, old_logp, adv, mask, *, clip_eps_low=None, clip_eps_high=4.0):
    ratio = torch.exp(logp - old_logp)
    low = 0.0 if clip_eps_low is None else 1 - clip_eps_low
    weight = torch.clamp(ratio, low, 1 + clip_eps_high).detach()
    return -weight * adv * logp


def ref_gspo(logp, old_logp, adv, mask, *, clip_eps_low=3e-4, clip_eps_high=4e-4):
    """s_i = exp(mean_t log r[i, t]) over the valid elements, PPO-clip on s_i, broadcast over the row."""
    m = mask.to(logp.dtype)
    seq = ((logp - old_logp) * m).sum(-1) / m.sum(-1)
    s = torch.exp(seq).unsqueeze(-1).expand_as(logp)
    return torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - clip_eps_low, 1 + clip_eps_high))


def ref_grpo_guard(logp, old_logp, adv, mask, *, std, mean_diff_sq, clip_eps_low=2e-6, clip_eps_high=None):
    """PPO-clip on exp(s * (l + ||dmu||^2 / (2 s^2)))."""
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(std * (logp - old_logp + mean_diff_sq / (2 * std**2)))
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high))


REFERENCES = {
    "ppo": (ref_ppo, {}),
    "grpo": (ref_ppo, {}),
    "dapo": (ref_ppo, {"clip_eps_high": 0.28}),
    "dr_grpo": (ref_ppo, {}),
    "gspo": (ref_gspo, {}),
    "sapo": (ref_sapo, {}),
    "cispo": (ref_cispo, {}),
    "spo": (ref_spo, {}),
    "gppo": (ref_gppo, {}),
    "clamp": (ref_clamp, {}),
    "reinforce": (ref_reinforce, {}),
    "grpo_guard": (ref_grpo_guard, {}),
}
"""objective name -> (reference per-element loss, preset overrides of the reference's defaults)."""

DEFAULT_AGG = {
    "ppo": "token_mean",
    "grpo": "seq_mean_token_mean",
    "dapo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "gspo": "seq_mean_token_mean",
    "sapo": "seq_mean_token_mean",
    "cispo": "token_mean",
    "spo": "token_mean",
    "gppo": "token_mean",
    "clamp": "token_mean",
    "reinforce": "token_mean",
    "grpo_guard": "token_mean",
}
"""The published aggregation of each objective (checked against the registry's defaults)."""
