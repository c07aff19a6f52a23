"""Flow-DPPO (Ping et al. 2026, arXiv:2606.11025): a divergence trust region for Gaussian denoising steps.

A flow-SDE step is a Gaussian kernel `N(mu_theta(x_t), s^2 I)` whose std `s` does not depend on the weights, so the
divergence between the behaviour kernel and the current one is exact and cheap:
`KL(N(mu_old, s^2) || N(mu_theta, s^2)) = ||mu_theta - mu_old||^2 / (2 s^2)` (the paper's eq. 14). Flow-DPPO keeps
the unclipped surrogate `-A r` and drops a step only when that divergence is at least `delta` **and** the ratio has
moved in the advantage's direction (r > 1 with A > 0, r < 1 with A < 0: the paper's asymmetric mask, eq. 18), so a
corrective step always trains and a step near the old policy trains whatever its ratio.

Both released implementations (Tencent-Hunyuan/UniRL `unirl/algorithms/flowdppo.py::_flowdppo_kl_adv_loss`,
verl-project/verl-omni `verl_omni/trainer/diffusion/diffusion_algos.py::FlowDPPOLoss`) reduce the squared mean
difference with a **mean** over latent elements, so `delta` (their `kl_mask_threshold`, 1e-5) is a per-element
KL; flowrl's `mean_diff_sq` is reduced like the log-probs (`DiffusionPolicy.reduce`, mean by default).
"""

from __future__ import annotations

import torch

from flowrl.core.masking import float_mask
from flowrl.core.objectives import Surrogate, register_objective


def gaussian_step_divergence(std, mean_diff_sq, *, scale_by_std: bool = True) -> torch.Tensor:
    """`D = ||mu_theta - mu_old||^2 / (2 s^2)`: the exact KL between two Gaussian step kernels with the same std.

    Args:
        std: the step's std `s` (`[B, K]` or broadcastable; the kernels' `std`, `sigma_t sqrt(|dt|)` for flow-SDE).
        mean_diff_sq: `||mu_theta - mu_old||^2` reduced over latent elements like the log-probs, `[B, K]`.
        scale_by_std (`bool`, defaults to True): divide by `2 s^2` (the KL); False gives `||dmu||^2 / 2`
            (the peers' `add_kl_coefficient: false`).
    """
    mean_diff_sq = torch.as_tensor(mean_diff_sq)
    if not scale_by_std:
        return mean_diff_sq / 2
    std = torch.as_tensor(std, dtype=mean_diff_sq.dtype, device=mean_diff_sq.device)
    return mean_diff_sq / (2 * std**2)


def flow_dppo_mask(
    ratio,
    adv,
    *,
    mask,
    std,
    mean_diff_sq,
    delta: float = 1e-5,
    scale_by_std: bool = True,
):
    """Flow-DPPO: the unclipped `-A r`, dropped where the step KL >= delta in the advantage's direction.

    `D = ||mu_theta - mu_old||^2 / (2 s^2)` (exact, per latent element); a step is dropped (value and gradient 0)
    when `D >= delta` and `r > 1, A > 0` (`clipped_high`) or `r < 1, A < 0` (`clipped_low`); every other step
    has `l = -A r`, gradient `-A r grad log pi`. Inputs as GRPO-Guard's: `std` and `mean_diff_sq` per step.
    """
    dtype = ratio.dtype
    a = adv.expand_as(ratio)
    # untrained (padding, deterministic) steps may have std 0: give them std 1 and no mean shift, so no 0/0
    std = torch.where(mask, torch.as_tensor(std, dtype=dtype, device=ratio.device).expand_as(ratio), 1.0)
    mean_diff_sq = torch.as_tensor(mean_diff_sq, device=ratio.device).detach().to(dtype).expand_as(ratio)
    mean_diff_sq = torch.where(mask, mean_diff_sq, 0.0)
    # D = ||mu - mu_old||^2 / (2 s^2): KL(N(mu_old, s^2) || N(mu, s^2)), the paper's eq. 14 (mean-reduced)
    divergence = gaussian_step_divergence(std, mean_diff_sq, scale_by_std=scale_by_std)  # [B, K]
    outside = divergence >= float(delta)  # float: YAML reads 1e-5 (no dot) as a string
    # eq. 18: drop only the steps outside the region that moved further in the advantage's direction
    dropped_high = outside & (ratio > 1) & (a > 0)
    dropped_low = outside & (ratio < 1) & (a < 0)
    keep = ~(dropped_high | dropped_low)
    value = torch.where(keep, -a * ratio, 0.0)  # l = -A r where kept; dl/dlog r = -A r as well
    fmask = float_mask(mask, dtype)
    count = fmask.sum().clamp_min(1.0)  # clamp: an all-masked batch reports zeros
    metrics = {
        "kl_new_old_mean": (divergence * fmask).sum() / count,
        "kl_new_old_max": (divergence * fmask).amax() if divergence.numel() else divergence.new_zeros(()),
        "kl_mask_fraction": (outside.to(dtype) * fmask).sum() / count,
    }
    return Surrogate(value, value, dropped_high & mask, dropped_low & mask, metrics=metrics)


register_objective(
    "flow_dppo",
    flow_dppo_mask,
    agg="token_mean",
    description="Flow-DPPO: -A r masked where the exact step KL >= 1e-5 in the advantage's direction "
    "(arXiv:2606.11025)",
)
