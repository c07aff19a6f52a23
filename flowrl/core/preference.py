"""Preference objectives on the `[B, K]` core: Diffusion-DPO and DGPO as losses of groups that share their elements.

Both compare the samples of a group (a DPO pair; a DGPO prompt group) at the same elements: element `k` of every
member is the same flow-matching draw `(t_k, eps_k)`. The trainer passes `logp = -l_theta` and `old_logp = -l_ref`,
minus each draw's flow-matching error `l = mean_d (v(x_t, t) - (eps - x1))^2` under the trained network and under
the frozen reference, so the element log-ratio is the implicit reward of the ELBO surrogate

    x_{i,k} = l_ref(i, k) - l_theta(i, k).

A group's margin at element `k` is a weighted sum over its members, and the loss of that (group, element) is a
logistic loss of the margin:

    z_{g,k} = sum_{i in g} c_i x_{i,k},        L_{g,k} = s * -log sigmoid(z_{g,k}).

- `diffusion_dpo` (Wallace et al. 2023, arXiv:2311.12908 eq. 14 with `T omega(lambda_t)` folded into beta, as
  Flow-GRPO's `train_sd3_dpo.py` and Flow-Factory's `trainers/dpo.py` write it for flow matching): the group is a
  pair, `A = +1` for the chosen and `-1` for the rejected sample, `c_i = (beta / 2) A_i`, `s = 1`:
  `L = -log sigmoid(-(beta / 2) [(l_theta^w - l_ref^w) - (l_theta^l - l_ref^l)])`.
- `dgpo` (Luo et al. 2025, arXiv:2510.08425; Luo-Yihong/DGPO `train_sd3_dgpo.py`): the group is a prompt's samples
  with their group-relative advantages `A`, `c_i = beta A_i / n_g` (`n_g` the group's members), `s = 1 / beta`:
  the code back-propagates `sg(sigmoid(-z_g)) A_i l_theta(i)` averaged over the samples, whose gradient is exactly
  that of this loss (its value is logged as the loss). Optionally the code's DSM clip: the gradient of `l_theta(i)`
  stops where the ratio to a lagged copy, `r = exp(l_old - l_theta)`, left `[1 - eps, 1 + eps]` in the advantage's
  direction (`A > 0`: `r > 1 + eps`; else `r < 1 - eps`); the margins still use every member.

Each element carries its group's loss, so the core's `token_mean` over the elements is the mean over (group,
element) of `n_g L_{g,k}` / mean group size: for pairs, the mean over pairs and draws. The surrogate returns that
value and `dv/dx = n_g s (-sigmoid(-z)) c_i`, its exact gradient. The group sums run over the global batch: with
several processes they are summed across them (`flowrl.core.dist`), so the objectives are `batch_statistics` ones
and the update scheduler keeps every process in step and scores a mini-batch's micro-batches in two passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowrl.core.dist import all_reduce_sum, world_size
from flowrl.core.masking import greater, less
from flowrl.core.objectives import Surrogate, register_objective


PREFERENCES = ("diffusion_dpo", "dgpo")
"""The preference objectives (their elements must be draws shared by each group's members)."""


def group_sums(values: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sums, counts)` `[B, K]`: at each valid element, the sum of `values [B, K]` over the valid elements of the
    same column whose rows share its group (`group [B]` or `[B, K]`, integer ids, the same on every process), and
    how many there are; 0 at masked elements. Summed over the processes when several run (then without gradient;
    with one, differentiable in `values`)."""
    b, k = values.shape
    mask = mask.bool()
    ids = group.round().long() if group.is_floating_point() else group.long()
    ids = ids.reshape(b, -1).expand(b, k)  # [B, K]
    ids = torch.where(mask, ids, 0)
    local = int(ids.max()) + 1 if b and k else 0
    many = world_size() > 1
    slots = int(all_reduce_sum(torch.tensor(float(local), device=values.device)).item()) if many else local
    flat = ids * k + torch.arange(k, device=values.device)  # [B, K] the (group, column) slot
    fmask = mask.to(values.dtype)
    table = torch.zeros(2, slots * k, dtype=values.dtype, device=values.device)
    table = table.index_put((torch.zeros_like(flat), flat), values * fmask, accumulate=True)
    table = table.index_put((torch.ones_like(flat), flat), fmask, accumulate=True)
    if many:
        table = all_reduce_sum(table)
    return table[0][flat] * fmask, table[1][flat] * fmask


def preference_margins(log_ratio, adv, group, mask, *, beta: float, form: str):
    """`(z, counts, c)` `[B, K]` each: every element's group margin `z_{g,k}`, its group's member count and the
    element's weight `c_i` in the margin (`diffusion_dpo`: `beta A / 2`; `dgpo`: `beta A / n_g`)."""
    adv = adv.expand_as(log_ratio).to(log_ratio.dtype)  # [B, K]
    sums, counts = group_sums(adv * log_ratio, group, mask)  # [B, K] sum_i A_i x_i, n_g
    if form == "diffusion_dpo":
        coef = 0.5 * beta * adv  # [B, K]
        return 0.5 * beta * sums, counts, coef
    if form == "dgpo":
        n = counts.clamp_min(1.0)  # masked elements: no group
        return beta * sums / n, counts, beta * adv / n
    raise ValueError(f"preference form must be one of {', '.join(PREFERENCES)}, got {form!r}")


def preference_loss(log_ratio, adv, group, mask=None, *, beta: float = 100.0, form: str = "diffusion_dpo"):
    """The preference loss by its definition (differentiable in `log_ratio`): the mean over the valid elements of
    `s * -log sigmoid(z_{g,k})` of each element's group (see the module docstring; `s = 1 / beta` for `dgpo`).

    Shapes: `log_ratio [B, K]`, `adv [B]` or `[B, K]`, `group [B]` integer ids, `mask [B, K]` (default all)."""
    mask = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else mask.bool()
    adv = adv.reshape(adv.shape[0], -1)  # [B, 1] or [B, K]
    z, _, _ = preference_margins(log_ratio, adv, group, mask, beta=beta, form=form)  # [B, K]
    scale = 1.0 / beta if form == "dgpo" else 1.0
    fmask = mask.to(log_ratio.dtype)
    # L = s * -log sigmoid(z) = s * softplus(-z) per element, averaged over the valid elements
    return (scale * F.softplus(-z) * fmask).sum() / fmask.sum().clamp_min(1.0)


def _preference(log_ratio, adv, mask, group, beta, form, flags=None) -> Surrogate:
    """The per-element value `s softplus(-z)` and its gradient `n_g s (-sigmoid(-z)) c_i` (zero where `flags`)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    z, counts, coef = preference_margins(log_ratio, adv, group, mask, beta=beta, form=form)  # [B, K]
    scale = 1.0 / beta if form == "dgpo" else 1.0
    value = scale * F.softplus(-z)  # [B, K]
    grad = -counts * scale * torch.sigmoid(-z) * coef  # [B, K] d(sum_j v_j)/dx_i over i's group
    high, low = flags if flags is not None else (None, None)
    if flags is not None:  # the DSM clip: no gradient through the clipped elements' own error
        grad = grad * (1 - (high + low))
    fmask = mask.to(log_ratio.dtype)
    count = fmask.sum().clamp_min(1.0)
    metrics = {
        "preference_accuracy": (greater(z, 0.0) * fmask).sum() / count,  # the implicit accuracy (Flow-GRPO's)
        "preference_margin": (z * fmask).sum() / count,
    }
    return Surrogate(value, grad, high, low, metrics=metrics)


def diffusion_dpo(ratio, adv, *, log_ratio, mask, group, beta: float = 100.0):
    """Diffusion-DPO (Wallace et al. 2023, arXiv:2311.12908 eq. 14) on flow-matching draws shared by each pair.

    `L = -log sigmoid((beta / 2) sum_{i in pair} A_i x_i)` per draw, `A = +1` chosen / `-1` rejected,
    `x = l_ref - l_theta`: `-log sigmoid(-(beta / 2) [(l_theta^w - l_ref^w) - (l_theta^l - l_ref^l)])`.
    `group` `[B, K]` are the pair ids; log 2 at `theta = ref`.
    """
    return _preference(log_ratio, adv, mask, group, beta, "diffusion_dpo")


def dgpo(
    ratio, adv, *, log_ratio, mask, group, beta: float = 100.0, clip_eps_low: float | None = None, clip_log_ratio=None
):
    """DGPO: group-level DPO over a prompt's samples (Luo et al. 2025, arXiv:2510.08425; Luo-Yihong/DGPO).

    `L = (1 / beta) -log sigmoid((beta / n_g) sum_{i in g} A_i x_i)` per shared draw, `A` the group-relative
    advantages; gradient `sigmoid(-z) A_i grad l_theta(i)` (the code's `sg(sigmoid(.)) A dsm`). With
    `clip_eps_low` and `clip_log_ratio = l_old - l_theta` (a lagged copy's error minus the current one), the code's
    DSM clip: no gradient where `A > 0` and `r > 1 + eps`, or `A <= 0` and `r < 1 - eps`, `r = exp(clip_log_ratio)`.
    """
    flags = None
    if clip_eps_low is not None:
        if clip_log_ratio is None:
            raise ValueError("dgpo's DSM clip (clip_eps_low) needs clip_log_ratio (l_old - l_theta per element)")
        r = torch.exp(torch.as_tensor(clip_log_ratio, dtype=log_ratio.dtype, device=log_ratio.device))  # [B, K]
        a = adv.expand_as(log_ratio)
        positive = greater(a, 0.0)  # [B, K] 0/1
        flags = (positive * greater(r, 1.0 + clip_eps_low), (1 - positive) * less(r, 1.0 - clip_eps_low))
    return _preference(log_ratio, adv, mask, group, beta, "dgpo", flags)


register_objective(
    "diffusion_dpo",
    diffusion_dpo,
    agg="token_mean",
    batch_statistics=True,
    description="Diffusion-DPO: -log sigmoid of a pair's implicit-reward margin at shared draws (arXiv:2311.12908)",
)
register_objective(
    "dgpo",
    dgpo,
    agg="token_mean",
    batch_statistics=True,
    description="DGPO: group-level DPO over advantage-weighted implicit rewards at shared draws (arXiv:2510.08425)",
)
