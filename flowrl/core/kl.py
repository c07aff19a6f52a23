"""KL estimators and proximity regularisers.

Sample estimators of `KL(pi_theta || pi_ref)` from log-probs of samples drawn from `pi_theta`
(Schulman 2020, "Approximating KL divergence"), with `l = log pi_ref - log pi_theta`:
`k1 = -l`, `k2 = l^2 / 2`, `k3 = (e^l - 1) - l`. Closed-form regularisers for Gaussian step kernels
and flow velocities. All are zero at equality.
"""

from __future__ import annotations

import torch

from flowrl.core.ratios import LOG_RATIO_CLAMP, compute_dtype, reduce_elements
from flowrl.registry import Registry


KL_ESTIMATORS: Registry = Registry("KL estimator")


def _log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    dtype = compute_dtype(logp, ref_logp)
    return ref_logp.to(dtype) - logp.to(dtype)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi_theta - log pi_ref: unbiased, high variance, can be negative."""
    return -_log_ratio(logp, ref_logp)


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi_theta - log pi_ref)^2 / 2: low variance, biased, always >= 0."""
    return 0.5 * _log_ratio(logp, ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = (pi_ref/pi_theta - 1) - log(pi_ref/pi_theta): unbiased, >= 0 (GRPO, arXiv:2402.03300 eq. 4)."""
    # clamp: exp of a log-ratio beyond +-20 overflows fp32 and says nothing more (verl clamps too)
    log_ratio = _log_ratio(logp, ref_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(log_ratio) - log_ratio


def kl_estimate(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Element-wise KL estimate by estimator name (`k1`, `k2`, `k3`)."""
    return KL_ESTIMATORS.get(name)(logp, ref_logp)


def gaussian_mean_kl(mean, ref_mean, std, *, dt=None, reduce: str = "mean") -> torch.Tensor:
    """KL between two Gaussian step kernels with the same std, reduced over each sample's elements.

    Without `dt`: the exact `KL(N(mu, s^2) || N(mu_ref, s^2)) = red_d (mu - mu_ref)_d^2 / (2 s^2)` where
    `s` is the step's std (Flow-GRPO paper, arXiv:2505.05470, with `s = sigma_t sqrt(|dt|)`).

    With `dt`: Flow-GRPO's **code** form `red_d (mu - mu_ref)^2 / (2 sigma_t^2)` with `sigma_t = s / sqrt(|dt|)`,
    i.e. the exact KL times `|dt|`; it equals a per-step rescaled KL coefficient. Pass `dt` only for parity
    with Flow-GRPO's released runs.

    Args:
        mean, ref_mean (`torch.Tensor`): `[B, ...]` (`mean` carries the gradient).
        std (`torch.Tensor` or `float`): the per-step std `s`, scalar or `[B]`.
        dt (`torch.Tensor` or `float`, *optional*): the step size `sigma_next - sigma`.
        reduce (`str`, defaults to `"mean"`): `"mean"` or `"sum"` over the non-batch dimensions.

    Returns:
        `torch.Tensor` `[B]`.
    """
    dtype = compute_dtype(mean, ref_mean)
    mean, ref_mean = mean.to(dtype), ref_mean.to(dtype)
    std = torch.as_tensor(std, dtype=dtype, device=mean.device)
    if std.ndim >= 1:
        std = std.reshape(std.shape + (1,) * (mean.ndim - std.ndim))
    kl = reduce_elements((mean - ref_mean) ** 2 / (2 * std**2), reduce)  # [B]
    if dt is not None:
        kl = kl * torch.as_tensor(dt, dtype=dtype, device=mean.device).abs()
    return kl


def diag_gaussian_kl(mean, std, ref_mean=0.0, ref_std=1.0, *, reduce: str = "mean") -> torch.Tensor:
    """Exact `KL(N(mu, s^2) || N(mu_ref, s_ref^2))` for diagonal Gaussians, reduced over elements.

    `log(s_ref/s) + (s^2 + (mu - mu_ref)^2) / (2 s_ref^2) - 1/2` per element; with the defaults it is the
    KL to the standard normal prior used by FIND's initial-noise policy (arXiv:2407.19453).
    """
    dtype = compute_dtype(mean, torch.as_tensor(std))
    mean = mean.to(dtype)
    std = torch.as_tensor(std, dtype=dtype, device=mean.device).expand_as(mean)
    ref_mean = torch.as_tensor(ref_mean, dtype=dtype, device=mean.device)
    ref_std = torch.as_tensor(ref_std, dtype=dtype, device=mean.device)
    kl = torch.log(ref_std / std) + (std**2 + (mean - ref_mean) ** 2) / (2 * ref_std**2) - 0.5
    return reduce_elements(kl, reduce)


def velocity_mse(velocity, ref_velocity, *, reduce: str = "mean") -> torch.Tensor:
    """`red_d (v - v_ref)^2`: the tractable W2 bound of ORW-CFM-W2 / AC-Flow (arXiv:2502.06061)."""
    dtype = compute_dtype(velocity, ref_velocity)
    return reduce_elements((velocity.to(dtype) - ref_velocity.to(dtype)) ** 2, reduce)
