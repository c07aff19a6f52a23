"""Text-literature objectives that read the policy's entropy or its covariance with the advantage.

`clip_cov` and `kl_cov` (arXiv:2505.22617) act on the tokens whose log-probability covaries most with the
advantage; `r2vpo` constrains the ratio's variance instead of clipping it; `sspo` and `espo` set clip ranges from
token entropies, and the `high_entropy` preset trains DAPO on the batch's highest-entropy tokens. Like every
objective of `flowrl.core.text`, each returns the per-element value `v` and `g = dv/dx`; batch
statistics go through `flowrl.core.dist`, so every process uses the global batch's. The tests check value and
gradient against a direct autograd implementation (`tests/core/test_llm_objectives.py`).
"""

from __future__ import annotations

import torch

from flowrl.core.dist import all_reduce_sum, gather_valid
from flowrl.core.objectives import Surrogate, _clip_between, ppo_clip, register_objective
from flowrl.core.text.sequence import segment_log_ratio, segment_mean


# ----------------------------------------------------------------------------------------------
# surrogates
# ----------------------------------------------------------------------------------------------


def clip_cov(
    ratio,
    adv,
    *,
    logp,
    mask,
    state,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    cov_fraction: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    seed: int = 0,
):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617 sec. 4).

    PPO-clip, plus: among the tokens PPO does not clip whose centred covariance `(A - mean A)(log pi - mean
    log pi)` (means over the global batch) lies in `(cov_low, cov_high)`, a random `max(1, floor(cov_fraction
    * N))` of this process's N valid tokens lose their loss and gradient (verl's `clip_cov`). The draw is seeded
    by `seed` and the call count kept in `state`, so a resumed run draws what the uninterrupted one did.
    """
    terms = ppo_clip(ratio, adv, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    a = adv.expand_as(ratio)
    cov = _centred_cov(a, logp, mask)
    eligible = mask & (terms.clipped_high == 0) & (terms.clipped_low == 0) & (cov > cov_low) & (cov < cov_high)
    candidates = torch.nonzero(eligible.reshape(-1)).reshape(-1)
    count = max(1, int(cov_fraction * int(mask.sum())))
    generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(state["calls"]) * 101 + _rank())
    state["calls"] += 1
    chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:count].to(candidates.device)]
    keep = torch.ones(ratio.numel(), dtype=ratio.dtype, device=ratio.device)
    keep[chosen] = 0.0
    keep = keep.reshape(ratio.shape)
    metrics = {"cov_selected_frac": (1 - keep).sum() / mask.sum().clamp_min(1)}
    return terms._replace(value=terms.value * keep, coef=terms.coef * keep, metrics=metrics)


def kl_cov(ratio, adv, *, logp, old_logp, mask, cov_fraction: float = 2e-4, beta: float = 1.0):
    """KL-Cov (arXiv:2505.22617 sec. 4): no clip, `l = -A r`, plus `beta |log pi - log pi_old|` on the top
    `max(1, floor(cov_fraction * N))` tokens of the global batch by centred covariance `(A - mean A)(log pi - mean
    log pi)`; their gradient gains `beta sign(log r)` (`beta`: flowrl's one name for a KL weight)."""
    a = adv.expand_as(ratio)
    cov = _centred_cov(a, logp, mask)
    values = gather_valid(cov, mask)
    count = max(1, int(cov_fraction * values.numel())) if values.numel() else 0
    selected = torch.zeros_like(mask)
    if count:
        threshold = torch.topk(values, min(count, values.numel())).values[-1]
        selected = mask & (cov >= threshold)
    log_ratio = logp - old_logp
    value = -a * ratio + selected * beta * log_ratio.abs()
    coef = -a * ratio + selected * beta * torch.sign(log_ratio)
    metrics = {"cov_selected_frac": selected.sum() / mask.sum().clamp_min(1)}
    return Surrogate(value, coef, None, None, metrics=metrics)


def _centred_cov(a, logp, mask):
    """`(A - mean A)(log pi - mean log pi)` with means over the valid elements of the global batch."""
    fm = mask.to(a.dtype)
    sums = all_reduce_sum(torch.stack([(a * fm).sum(), (logp * fm).sum(), fm.sum()]))
    count = sums[2].clamp_min(1.0)
    return (a - sums[0] / count) * (logp - sums[1] / count) * fm


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def r2vpo(ratio, adv, *, mask, state, var_target: float = 0.01, dual_lr: float = 0.1):
    """R2VPO: a ratio-variance constraint instead of a clip, solved primal-dual (arXiv:2601.03320).

    `L = -E[r A] + lambda (Var(r) - delta)` over the valid elements of the global batch, with the dual ascent
    `lambda <- max(0, lambda + eta (Var(r) - delta))` after each call (lambda lives in `state` and is
    checkpointed). Per element: value `-A r + lambda ((r - m)^2 - delta)`, gradient `-A r + 2 lambda r (r - m)`
    (with `token_mean`, exactly the gradient of the batch objective; `m` the batch mean ratio).
    """
    fm = mask.to(ratio.dtype)
    sums = all_reduce_sum(torch.stack([(ratio * fm).sum(), (ratio * ratio * fm).sum(), fm.sum()]))
    count = sums[2].clamp_min(1.0)
    mean = sums[0] / count
    var = (sums[1] / count - mean * mean).clamp_min(0.0)
    lam = torch.as_tensor(float(state["lambda"]), dtype=ratio.dtype, device=ratio.device)
    value = -adv * ratio + lam * ((ratio - mean) ** 2 - var_target)
    coef = -adv * ratio + 2 * lam * ratio * (ratio - mean)
    state["lambda"] = max(0.0, float(lam) + dual_lr * (float(var) - var_target))
    return Surrogate(value, coef, None, None, metrics={"r2vpo_lambda": lam, "ratio_var": var})


def entropy_clip_eps(mean_entropy: torch.Tensor, reference: torch.Tensor, clip_eps: float, spread: float):
    """Entropy-adaptive clip range `eps (H / H_ref)^spread`, clamped to `[eps / 2, 2 eps]` (SSPO, ESPO)."""
    scale = (mean_entropy / reference.clamp_min(1e-8)).clamp_min(1e-8) ** spread
    return clip_eps * scale.clamp(0.5, 2.0)


def sspo(ratio, adv, *, mask, entropy, segment_ids, clip_eps_low: float = 0.2, entropy_spread: float = 1.0):
    """SSPO: sentence-level ratio with a clip range set by the sentence's mean entropy (arXiv:2511.04256).

    The ratio is the sentence's geometric mean (`segment_log_ratio`); its clip range is
    `eps (H_k / H)^spread` clamped to `[eps/2, 2 eps]`, `H_k` the sentence's mean token entropy and `H` the batch's
    (global) mean: uncertain sentences may move further, confident ones less.
    """
    h_seg = segment_mean(entropy, mask, segment_ids)  # [B, K]
    sums = all_reduce_sum(torch.stack([(entropy * mask).sum(), mask.sum().to(entropy.dtype)]))
    eps = entropy_clip_eps(h_seg, sums[0] / sums[1].clamp_min(1.0), clip_eps_low, entropy_spread)
    return _clip_between(ratio, adv, 1 - eps, 1 + eps)


def espo_log_ratio(log_ratio, mask, *, entropy, num_groups: int = 4):
    """ESPO's entropy-grouped log-ratio (arXiv:2512.00499): each response's tokens are split into `num_groups`
    entropy quantile bins; a token's ratio is the geometric mean over its bin."""
    return segment_mean(log_ratio, mask, entropy_groups(entropy, mask, num_groups))


def entropy_groups(entropy: torch.Tensor, mask: torch.Tensor, num_groups: int) -> torch.Tensor:
    """`[B, K]` group index in `0..num_groups-1` of each token by its entropy rank within its row (equal counts)."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    filled = torch.where(mask, entropy, torch.inf)
    rank = filled.argsort(dim=-1, stable=True).argsort(dim=-1)  # [B, K]; valid tokens first, by entropy
    n = mask.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(mask, (rank * num_groups) // n, 0).clamp_max(num_groups - 1)


def espo(ratio, adv, *, mask, entropy, num_groups: int = 4, clip_eps_low: float = 0.2, entropy_spread: float = 1.0):
    """ESPO: PPO-clip on entropy-group ratios with entropy-adaptive clip ranges (arXiv:2512.00499).

    Each group's clip range is `eps (H_g / H)^spread` clamped to `[eps/2, 2 eps]`, `H_g` the group's mean entropy
    and `H` the batch's; with one group this is GSPO's sequence ratio with PPO's clip.
    """
    groups = entropy_groups(entropy, mask, num_groups)
    h_group = segment_mean(entropy, mask, groups)
    sums = all_reduce_sum(torch.stack([(entropy * mask).sum(), mask.sum().to(entropy.dtype)]))
    eps = entropy_clip_eps(h_group, sums[0] / sums[1].clamp_min(1.0), clip_eps_low, entropy_spread)
    return _clip_between(ratio, adv, 1 - eps, 1 + eps)


# ----------------------------------------------------------------------------------------------
# the registry (docs/objectives.md: the paper, defaults and the choices made for each)
# ----------------------------------------------------------------------------------------------

register_objective(
    "sspo",
    sspo,
    batch_statistics=True,
    log_ratio=segment_log_ratio,
    agg="token_mean",
    description="SSPO: sentence geometric-mean ratio, clip range from sentence entropy (arXiv:2511.04256)",
)

register_objective(
    "espo",
    espo,
    batch_statistics=True,
    log_ratio=espo_log_ratio,
    agg="token_mean",
    description="ESPO: entropy-group ratios with entropy-adaptive clip ranges (arXiv:2512.00499)",
)

register_objective(
    "high_entropy",
    ppo_clip,
    agg="token_mean",
    clip_eps_high=0.28,
    top_entropy_quantile=0.2,
    batch_statistics=True,
    description="80/20 rule: DAPO on the 20% highest-entropy tokens of the batch (arXiv:2506.01939)",
)

register_objective("clip_cov", clip_cov, agg="token_mean", batch_statistics=True, init_state=lambda: {"calls": 0})

register_objective(
    "kl_cov",
    kl_cov,
    batch_statistics=True,
    agg="token_mean",
    description="KL-Cov: unclipped -A r plus |log r| on the top-covariance tokens (arXiv:2505.22617 sec. 4)",
)

register_objective("r2vpo", r2vpo, agg="token_mean", batch_statistics=True, init_state=lambda: {"lambda": 0.0})
