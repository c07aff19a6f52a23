"""Log-ratio estimators and normalisers: everything that turns log-probs into `log_ratio[B, K]`.

All math runs in fp32 (fp64 inputs stay fp64).
"""

from __future__ import annotations

import math

import torch

from flowrl.core.masking import float_mask


LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before `exp`: exp(20) ~ 4.9e8 stays finite in fp32 (verl does the same)."""

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 when any input is fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def reduce_elements(x: torch.Tensor, reduce: str) -> torch.Tensor:
    """Mean or sum over every dimension but the first (the latent elements of one sample)."""
    dims = tuple(range(1, x.ndim))
    if reduce == "mean":
        return x.mean(dim=dims)
    if reduce == "sum":
        return x.sum(dim=dims)
    raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")


def _per_sample(std: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar / `[B]` std against a `[B, ...]` tensor."""
    std = torch.as_tensor(std, dtype=like.dtype, device=like.device)
    return std.reshape(std.shape + (1,) * (like.ndim - std.ndim)) if std.ndim >= 1 else std


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std, *, reduce: str = "mean") -> torch.Tensor:
    """Log-density of `x` under `N(mean, std^2 I)`, reduced over each sample's elements.

    `log p = red_d[ -(x_d - mu_d)^2 / (2 s^2) - log s - log(2 pi)/2 ]` (DDPO, arXiv:2305.13301;
    Flow-GRPO, arXiv:2505.05470). `reduce="mean"` is the convention of every image RL codebase:
    it returns `log p_sum / D`, so a ratio built from it is the true ratio to the power `1/D`, which is why
    image clip ranges are tiny (1e-4 ... 2e-6). `reduce="sum"` is the true log-density.

    Args:
        x, mean (`torch.Tensor`): `[B, ...]`.
        std (`torch.Tensor` or `float`): scalar, `[B]`, or broadcastable to `x`; must be positive.
        reduce (`str`, defaults to `"mean"`): `"mean"` or `"sum"` over the non-batch dimensions.

    Returns:
        `torch.Tensor` `[B]` in fp32 (fp64 for fp64 inputs).
    """
    dtype = compute_dtype(x, mean, torch.as_tensor(std))
    x, mean = x.to(dtype), mean.to(dtype)
    std = _per_sample(std, x).to(dtype)
    log_density = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI  # [B, ...]
    return reduce_elements(log_density, reduce)


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised sequence log-ratio, broadcast back to `[B, K]`.

    `log s_i = (1/|o_i|) sum_t m[i,t] (logp - old_logp)[i,t]` (GSPO, arXiv:2507.18071): the log of the
    geometric-mean ratio over the sequence (for images: over the trained denoising steps). The gradient
    flows through the mean, so each element receives `1/|o_i|` of the sequence's gradient.
    """
    mask = float_mask(mask, log_ratio.dtype)
    seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)  # [B]; clamp: empty rows give 0
    return seq.unsqueeze(-1).expand_as(log_ratio)


def grpo_guard_log_ratio(log_ratio: torch.Tensor, std: torch.Tensor, mean_diff_sq: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard RatioNorm from a log-ratio (Wang et al. 2025, arXiv:2510.22319, sec. 3.2).

    `l~ = s * (l + b)` with `b = ||mu_theta - mu_old||^2 / (2 s^2)`, where `l = log pi_theta - log pi_old` of
    the stored transition and `s` the step's std. Under the old policy `l` has mean `-b` and a spread
    that scales with `1/s`; `l~` has mean 0 and a spread independent of `s`.

    Args:
        log_ratio (`torch.Tensor`): `[B, K]` per-step log-ratio (differentiable).
        std (`torch.Tensor`): per-step std `s`, broadcastable to `[B, K]`.
        mean_diff_sq (`torch.Tensor`): `||mu_theta - mu_old||^2` reduced over latent elements **the same way
            as the log-probs** (mean or sum), `[B, K]`; differentiable through `mu_theta`.
    """
    std = torch.as_tensor(std, dtype=log_ratio.dtype, device=log_ratio.device)
    return std * (log_ratio + mean_diff_sq.to(log_ratio.dtype) / (2 * std**2))


CLIP_REFERENCE_ELEMENTS = 16 * 64 * 64
"""Latent elements per sample at which the papers' image clip ranges were set: SD3.5 and FLUX.1 at 512 px
(16 channels x 64 x 64). Flow-GRPO's 1e-4 and GRPO-Guard's 2e-6 / 4e-6 are ranges for this size."""


def clip_for_latent_size(clip_eps: float, elements: int, reference_elements: int = CLIP_REFERENCE_ELEMENTS) -> float:
    """A clip range set at `reference_elements` latent elements per sample, moved to `elements`: the rule is
    `clip_eps * sqrt(reference_elements / elements)`.

    Why: a mean-reduced per-step log-ratio averages D per-element terms that are linear in the step's noise.
    GRPO-Guard's RatioNorm-ed one is `mean_d z_d dmu_d` with `z ~ N(0, 1)` under the old policy, so its spread over
    samples is `rms(dmu) / sqrt(D)` exactly; Flow-GRPO's raw one is that divided by the step std `s` plus a
    second-order bias. For the same per-element update `dmu`, a range that binds as often therefore scales as
    `1 / sqrt(D)`. The digits world (1 x 8 x 8 = 64 elements) moves GRPO-Guard's 2e-6 to 6.4e-5 (32x).

    Args:
        clip_eps (`float`): the range at `reference_elements` (a paper's or official config's value).
        elements (`int`): latent elements per sample of the run (channels x [frames x] height x width, before any
            packing: packing does not change the count).
        reference_elements (`int`, defaults to 65,536): the size `clip_eps` was set at.
    """
    if elements < 1 or reference_elements < 1:
        raise ValueError(f"latent sizes must be >= 1, got {elements=}, {reference_elements=}")
    return clip_eps * math.sqrt(reference_elements / elements)


def ratio_norm_grpo_guard(
    prev_sample: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std,
    *,
    reduce: str = "mean",
) -> torch.Tensor:
    """GRPO-Guard normalised log-ratio of one denoising step from its Gaussian quantities.

    Given the stored next state `x'`, the current and behaviour means `mu_theta`, `mu_old` and the step
    std `s` (shared by both policies), returns `s * (log N(x'; mu_theta, s) - log N(x'; mu_old, s) + b)`
    with `b = red_d (mu_theta - mu_old)^2 / (2 s^2)`; algebraically `red_d z_d * (mu_theta - mu_old)_d`
    with `z = (x' - mu_old) / s`, i.e. zero mean and step-independent spread under the old policy.

    Args:
        prev_sample (`torch.Tensor`): the stored next state `[B, ...]`.
        mean (`torch.Tensor`): `mu_theta` `[B, ...]` (carries the gradient).
        old_mean (`torch.Tensor`): `mu_old` `[B, ...]` stored at rollout.
        std (`torch.Tensor` or `float`): scalar or `[B]`.
        reduce (`str`, defaults to `"mean"`): how the log-probs are reduced over latent elements.

    Returns:
        `torch.Tensor` `[B]`.
    """
    log_ratio = gaussian_log_prob(prev_sample, mean, std, reduce=reduce) - gaussian_log_prob(
        prev_sample, old_mean, std, reduce=reduce
    )
    dtype = log_ratio.dtype
    mean_diff_sq = reduce_elements((mean.to(dtype) - old_mean.to(dtype)) ** 2, reduce)  # [B]
    std = torch.as_tensor(std, dtype=dtype, device=log_ratio.device)
    return grpo_guard_log_ratio(log_ratio, std, mean_diff_sq)
