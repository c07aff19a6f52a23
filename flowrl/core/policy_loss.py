"""`compute_policy_loss`: one registered objective on masked `[B, K]` log-probs, with its trust-region metrics.

It assembles `l = v + g * (x - sg(x))` from the objective's surrogate (`flowrl.core.objectives`), which has value
`v` and gradient `g * grad(x)` exactly, aggregates it (`flowrl.core.aggregation`) and reports the ratio and clip
statistics, in fp32, the same code for every modality.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.core.aggregation import aggregation_weights, linearised_loss
from flowrl.core.dist import gather_valid
from flowrl.core.masking import float_mask, greater, select_valid, select_valid_checked
from flowrl.core.objective_registry import (
    COMMON_HPARAMS,
    DIAGNOSTICS,
    PER_STEP_METRICS_MAX_K,
    RENAMED_HPARAMS,
    LogRatio,
    Surrogate,
    element_log_ratio,
    get_objective,
)
from flowrl.core.ratios import LOG_RATIO_CLAMP, compute_dtype
from flowrl.registry import unknown_name_error


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------


ENTROPY_TIE = 1e-5
"""Entropies closer than this (relative, at least absolute) to the `top_entropy_quantile` threshold are kept."""


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """`[B, K]` float, 1 where the entropy is at least the `(1 - rho)` quantile of the valid elements of the
    global batch (all processes; linear interpolation, as `torch.quantile` and trl), else 0.

    "Beyond the 80/20 rule" (Wang et al. 2025, arXiv:2506.01939 sec. 4): rho = 0.2 trains the 20% of tokens
    with the highest entropy ("forking tokens"). rho = 1 keeps every element, rho = 0 only the maximum.
    """
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"top_entropy_quantile must lie in [0, 1], got {rho}")
    values = gather_valid(entropy, mask)
    if values.numel() == 0:
        return mask.to(entropy.dtype)
    threshold = torch.quantile(values.double(), 1.0 - rho)
    # tokens sharing a prefix (a group's first tokens) have the same entropy, computed in batches of other shapes
    # it differs by rounding (~1e-7): entropies within ENTROPY_TIE of the threshold count as tied with it, so the
    # selection does not depend on the process count or the micro-batch size
    threshold = (threshold - ENTROPY_TIE * (1.0 + threshold.abs())).to(entropy.dtype)
    return ((entropy >= threshold) & mask).to(entropy.dtype)


def _check_shape(name: str, t: torch.Tensor, shape: torch.Size) -> None:
    if t.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} (like logp), got {tuple(t.shape)}")


def compute_policy_loss(
    name: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    entropy: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    state: dict | None = None,
    topk_logp: torch.Tensor | None = None,
    old_topk_logp: torch.Tensor | None = None,
    **hparams: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and diagnostics of the objective `name` on masked `[B, K]` log-probs.

    Args:
        name (`str`): a registered objective (`list_objectives()`); unknown names raise `ValueError`.
        logp (`torch.Tensor`): `[B, K]` log-probs under the current policy (carries the gradient). For an
            image policy K is denoising steps; for text, tokens. Any log-likelihood proxy works (FPO passes
            minus its flow-matching loss).
        old_logp (`torch.Tensor`): `[B, K]` behaviour-policy log-probs (no gradient).
        advantages (`torch.Tensor`): `[B]` (broadcast over K) or `[B, K]`.
        mask (`torch.Tensor`, *optional*): `[B, K]`, 1 where the element is trained; padding may hold
            any value, even NaN/inf, and never reaches the loss or the gradient.
        entropy (`torch.Tensor`, *optional*): `[B, K]` entropies of the current policy at each element (no
            gradient); needed by the objectives whose `inputs` name it (ASPO, SSPO, ESPO, DHPO's entropy mixing)
            and by `top_entropy_quantile`.
        segment_ids (`torch.Tensor`, *optional*): `[B, K]` integers, the segment (turn, sentence) of each element
            within its row (ST-PPO, SSPO); segments need not be contiguous.
        topk_logp, old_topk_logp (`torch.Tensor`, *optional*): `[B, K, V]` log-probs of each element's next-token
            support (V tokens) under the current policy (carries the gradient) and the behaviour policy; needed by
            the objectives whose `inputs` name them (TROLL, `flowrl.core.text.troll`).
        state (`dict`, *optional*): a stateful objective's controller state (`get_objective(name).init_state()`),
            updated in place; the caller checkpoints it.
        **hparams: the objective's hyper-parameters (see `get_objective(name).hparams`) and
            - `agg` (`str`): aggregation, defaults to the objective's (see `flowrl.core.aggregation`),
            - `weights` (`torch.Tensor`): per-element weights broadcastable to `[B, K]` (timestep weighting),
              multiplied onto the per-element loss (no gradient),
            - `norm_len` (`float`): the constant `L` of `seq_mean_token_sum_norm` (defaults to K),
            - `diagnostics` (`str`, defaults to `"full"`): `"full"` reports every metric below, `"clip"` only the
              clip fractions (the set trl and verl report; cheaper on long token batches), `"none"` only the
              objective's own metrics,
            - `top_entropy_quantile` (`float`): train only the elements whose entropy is in the top fraction
              rho of the batch's valid elements (across processes), with the normaliser unchanged ("Beyond the
              80/20 rule", Wang et al. 2025, arXiv:2506.01939 sec. 4; trl's `top_entropy_quantile`).

    Returns:
        `(loss, metrics)`: a scalar loss (fp32, or fp64 for fp64 inputs) and detached tensors:
        `clipfrac` (= high + low + dual), `clipfrac_high`, `clipfrac_low`, `clipfrac_dual`, `ratio_mean`,
        `ratio_std`, `ratio_min`, `ratio_max`,
        `approx_kl_k3` (k3 estimate of KL(pi_old || pi_theta) from the element log-ratios) and, when
        K <= 64, per-step rows `[K]` over the masked elements of each column: `ratio_mean_per_step`,
        `ratio_std_per_step`, `clipfrac_per_step` (the ratio the objective uses: GSPO's sequence ratio,
        GRPO-Guard's normalised one), `raw_ratio_mean_per_step`, `raw_ratio_std_per_step` (the plain
        `exp(logp - old_logp)`) and `count_per_step` (masked elements per column, to pool several calls).
    """
    objective = get_objective(name)
    agg = hparams.pop("agg", objective.agg)
    weights = hparams.pop("weights", None)
    norm_len = hparams.pop("norm_len", None)
    top_entropy = hparams.pop("top_entropy_quantile", objective.hparams.get("top_entropy_quantile"))
    diagnostics = hparams.pop("diagnostics", "full")
    if diagnostics not in DIAGNOSTICS:
        raise unknown_name_error("diagnostics", diagnostics, list(DIAGNOSTICS))
    for key in hparams:
        if key not in objective.hparams and key not in objective.required:
            if key in RENAMED_HPARAMS:
                raise ValueError(
                    f"hyper-parameter {key!r} of objective {name!r} was renamed: use {RENAMED_HPARAMS[key]}"
                )
            valid = sorted([*objective.hparams, *objective.required, *COMMON_HPARAMS])
            raise unknown_name_error("hyper-parameter", key, valid, where=f"for objective {name!r}")
    missing = [k for k in objective.required if k not in hparams]
    if missing:
        raise ValueError(f"objective {name!r} needs hyper-parameter(s) {', '.join(missing)}")
    hp = {**objective.hparams, **hparams}
    hp.pop("top_entropy_quantile", None)
    given = {
        "entropy": entropy,
        "segment_ids": segment_ids,
        "state": state,
        "topk_logp": topk_logp,
        "old_topk_logp": old_topk_logp,
    }
    wanted = [*objective.inputs, *(["entropy"] if top_entropy is not None else [])]
    for key in wanted:
        if given[key] is None:
            what = {
                "entropy": "per-element entropies [B, K]",
                "segment_ids": "per-element segment ids [B, K]",
                "state": f"its controller state (get_objective({name!r}).init_state())",
                "topk_logp": "the current policy's support log-probs [B, K, V]",
                "old_topk_logp": "the behaviour policy's support log-probs [B, K, V]",
            }[key]
            raise ValueError(f"objective {name!r} needs {key}= ({what})")

    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, K], got shape {tuple(logp.shape)}")
    shape = logp.shape
    _check_shape("old_logp", old_logp, shape)
    mask = torch.ones(shape, dtype=torch.bool, device=logp.device) if mask is None else mask
    _check_shape("mask", mask, shape)
    if advantages.ndim == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages [B] must have B={shape[0]} entries, got {advantages.shape[0]}")
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != shape:
        raise ValueError(f"advantages must be [B] or [B, K]={tuple(shape)}, got {tuple(advantages.shape)}")

    dtype = compute_dtype(logp, old_logp)
    fmask = float_mask(mask, dtype)  # [B, K] 0/1
    mask = mask.bool()
    # element ratios: the loss's gradient goes straight to logp (below), the log-ratio needs no graph
    element = objective.log_ratio is element_log_ratio
    with torch.set_grad_enabled(torch.is_grad_enabled() and not element):
        # padding may hold NaN/inf: select it away before any arithmetic so it cannot reach the loss or grads
        log_ratio, finite = select_valid_checked(logp.to(dtype) - old_logp.detach().to(dtype), mask, fmask)  # [B, K]
    adv = advantages.detach().to(dtype)  # [B, 1] or [B, K]
    if adv.shape == shape:
        adv = select_valid(adv, mask, fmask)

    inputs = {"mask": mask, "fmask": fmask, "adv": adv, "state": state, "log_ratio": log_ratio.detach()}
    wanted_inputs = {*objective.ratio_inputs, *objective.surrogate_inputs}
    for key, value in (("logp", logp), ("old_logp", old_logp)):
        if key in wanted_inputs:
            value = value.detach().to(dtype)
            # a log-ratio finite everywhere needs both log-probs finite everywhere: the product alone masks them
            inputs[key] = value * fmask if finite else select_valid(value, mask, fmask)
    for key, value in (("entropy", entropy), ("segment_ids", segment_ids)):
        if value is not None:
            _check_shape(key, value, shape)
            fill = 0.0 if key == "entropy" else 0
            inputs[key] = torch.where(mask, value.detach().to(dtype if key == "entropy" else torch.long), fill)
    for key, value in (("topk_logp", topk_logp), ("old_topk_logp", old_topk_logp)):
        if value is not None:  # [B, K, V]; padding zeroed; the current policy's keeps its gradient
            if value.ndim != 3 or value.shape[:2] != shape:
                raise ValueError(f"{key} must be [B, K, V] with [B, K]={tuple(shape)}, got {tuple(value.shape)}")
            value = value.to(dtype) if key == "topk_logp" else value.detach().to(dtype)
            inputs[key] = torch.where(mask.unsqueeze(-1), value, 0.0)
    x = objective.log_ratio(
        log_ratio, mask, **{k: hp[k] for k in objective.ratio_params}, **{k: inputs[k] for k in objective.ratio_inputs}
    )  # [B, K]
    extra = x if isinstance(x, LogRatio) else LogRatio(x)
    x = extra.value
    kwargs = {k: hp[k] for k in objective.surrogate_params}
    kwargs.update({k: inputs[k] for k in objective.surrogate_inputs})
    # a sequence ratio (GSPO) with sequence advantages is constant along each row: on long rows the surrogate
    # runs on [B, 1] and each row's loss carries its aggregation coefficients' row sum (same loss and gradient)
    row_level = (
        shape[-1] > PER_STEP_METRICS_MAX_K
        and x.stride(-1) == 0
        and adv.shape[-1] == 1
        and top_entropy is None
        and extra.penalty is None
        and not set(objective.surrogate_inputs) - {"state"}
    )
    if row_level:
        x = x[:, :1]  # [B, 1]
    with torch.no_grad():
        ratio = torch.exp(x.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, K] ([B, 1] row-level)
        terms = objective.surrogate(ratio, adv, **kwargs)
        if top_entropy is not None:
            keep = top_entropy_mask(inputs["entropy"], mask, top_entropy)  # [B, K]
            terms = terms._replace(value=terms.value * keep, coef=terms.coef * keep)
            if extra.penalty is not None:
                extra = extra._replace(penalty=extra.penalty * keep)
        if diagnostics == "none":
            metrics = {}
        elif diagnostics == "clip":
            metrics = _clip_metrics(terms, fmask, row_level)
        elif row_level:
            metrics = _row_metrics(ratio, terms, log_ratio.detach(), fmask)
        else:
            metrics = _metrics(ratio, terms, log_ratio.detach(), fmask, ratio_is_raw=x is log_ratio)
        if top_entropy is not None:
            metrics["entropy_kept_frac"] = (keep * fmask).sum() / fmask.sum().clamp_min(1.0)
        metrics.update(terms.metrics or {})
        metrics.update({k: v.detach() for k, v in (extra.metrics or {}).items()})

    # aggregate(l * w) = sum(a * w * l) with a = aggregation_weights(mask)
    coeffs = aggregation_weights(fmask, agg, norm_len=norm_len)  # [B, K]
    if weights is not None:
        weights = torch.as_tensor(weights, dtype=dtype, device=logp.device).detach().expand(shape)
        coeffs = coeffs * select_valid(weights, mask, fmask)
    if row_level:
        coeffs = coeffs.sum(-1, keepdim=True)  # [B, 1]
    # the per-element loss v + g * (x - sg(x)): value v, gradient g * grad(x); for element ratios grad(x) is the
    # mask, which coeffs already carries (0 off the mask), so the gradient is taken at logp itself
    loss = linearised_loss(logp.to(dtype) if element else x, terms.value, terms.coef, coeffs)
    if extra.penalty is not None:  # an estimator's own differentiable per-element loss (TROLL's regression)
        loss = loss + torch.dot(extra.penalty.reshape(-1), coeffs.expand(shape).reshape(-1))
    return loss, metrics


def _clip_metrics(terms: Surrogate, fmask, row_level: bool) -> dict[str, torch.Tensor]:
    """The clip fractions alone (`diagnostics="clip"`): masked means of the three flags."""
    if all(f is None for f in terms[2:5]):  # an objective without a clip (SAPO, VESPO, REINFORCE, ...)
        zero = fmask.new_zeros(())
        return dict.fromkeys(("clipfrac", "clipfrac_high", "clipfrac_low", "clipfrac_dual"), zero)
    weight = fmask.sum(-1, keepdim=True) if row_level else fmask  # row-level flags are [B, 1], counted n_i times
    count = weight.sum().clamp_min(1.0)  # clamp: an all-masked batch reports zeros
    zero = weight.new_zeros(())
    fracs = [
        zero if f is None else torch.dot(float_mask(f, weight.dtype).reshape(-1), weight.reshape(-1)) / count
        for f in terms[2:5]
    ]
    return {
        "clipfrac": fracs[0] + fracs[1] + fracs[2],
        "clipfrac_high": fracs[0],
        "clipfrac_low": fracs[1],
        "clipfrac_dual": fracs[2],
    }


def _row_metrics(ratio, terms: Surrogate, log_ratio, fmask) -> dict[str, torch.Tensor]:
    """`_metrics` for a row-constant surrogate: `ratio` and the flags are `[B, 1]`, each row counted `n_i` times."""
    n = fmask.sum(-1, keepdim=True)  # [B, 1]
    count = n.sum()
    shifted = ratio - 1  # [B, 1]
    flags = [torch.zeros_like(n) if f is None else float_mask(f, n.dtype) for f in terms[2:5]]
    lr = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, K]: the element log-ratios
    k3 = torch.dot((torch.exp(lr) - 1 - lr).reshape(-1), fmask.reshape(-1))  # k3 of the element ratios
    sums = torch.stack([*((f * n).sum() for f in flags), (shifted * n).sum(), (shifted * shifted * n).sum(), k3])
    return _summary(sums, count, ratio, greater(n, 0.0))  # empty rows are not valid ratios


def _summary(sums, count, ratio, valid) -> dict[str, torch.Tensor]:
    """The scalar metrics from the masked sums `[high, low, dual, r - 1, (r - 1)^2, k3]` over `count` elements,
    and the extremes of `ratio` where the 0/1 `valid` (broadcastable to it) is set."""
    # clamp: an all-masked batch reports zeros, not NaN
    clip_high, clip_low, clip_dual, mean_shift, mean_sq, k3_mean = (sums / count.clamp_min(1.0)).unbind()
    ratio_mean = mean_shift + 1
    # invalid entries are pushed past every valid ratio (ratios are at most exp(20)); an empty batch reports the mean
    big = torch.finfo(ratio.dtype).max
    pad = torch.rsub(valid, big, alpha=big)  # big (1 - valid)
    has_valid = count > 0
    return {
        "clipfrac": clip_high + clip_low + clip_dual,
        "clipfrac_high": clip_high,
        "clipfrac_low": clip_low,
        "clipfrac_dual": clip_dual,
        "ratio_mean": ratio_mean,
        "ratio_std": torch.addcmul(mean_sq, mean_shift, mean_shift, value=-1).clamp_min(0.0).sqrt(),
        "ratio_min": torch.where(has_valid, (ratio + pad).amin(), ratio_mean),
        "ratio_max": torch.where(has_valid, (ratio - pad).amax(), ratio_mean),
        "approx_kl_k3": k3_mean,
    }


def _metrics(ratio, terms: Surrogate, log_ratio, fmask, *, ratio_is_raw: bool) -> dict[str, torch.Tensor]:
    """Diagnostics as masked sums of a few per-element rows.

    Short sequences (denoising steps) reduce a stacked `[8, B, K]` tensor once, which also gives the
    per-step rows; long ones (tokens) use one fused dot product per row instead of building the stack, and
    take k3 from the ratio already computed when the objective's ratio is the element ratio (`ratio_is_raw`).
    """
    dtype = ratio.dtype
    shifted = ratio - 1  # around 1, E[(r-1)^2] - (E[r]-1)^2 keeps its digits in fp32
    lr = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    flags = [terms.clipped_high, terms.clipped_low, terms.clipped_dual]
    per_step_wanted = ratio.shape[-1] <= PER_STEP_METRICS_MAX_K
    if per_step_wanted:
        flags = [torch.zeros_like(ratio) if f is None else float_mask(f, dtype) for f in flags]
        # k3 = (rho - 1) - log rho with rho = pi_theta / pi_old on samples from pi_old (Schulman 2020)
        raw_shifted = torch.expm1(lr)  # the plain element ratio - 1
        rows = [*flags, shifted, shifted * shifted, raw_shifted - lr, raw_shifted, raw_shifted * raw_shifted]
        per_step = (torch.stack(rows) * fmask).sum(1)  # [8, K]
        count_per_step = fmask.sum(0)  # [K]
        sums, count = per_step[:6].sum(1), count_per_step.sum()
    else:
        flat = fmask.reshape(-1)
        masked_shift = shifted * fmask  # [B, K]
        k3 = shifted - lr if ratio_is_raw else torch.exp(lr) - 1 - lr  # [B, K], as above
        zero = flat.new_zeros(())
        sums = torch.stack(
            [
                *(zero if f is None else torch.dot(float_mask(f, dtype).reshape(-1), flat) for f in flags),
                masked_shift.sum(),
                torch.dot(masked_shift.reshape(-1), shifted.reshape(-1)),
                torch.dot(k3.reshape(-1), flat),
            ]
        )
        count = flat.sum()
    metrics = _summary(sums, count, ratio, fmask)
    if per_step_wanted:
        # [8, K]: high, low, dual, r-1, (r-1)^2, k3, raw-1, (raw-1)^2
        means = per_step / count_per_step.clamp_min(1.0)
        metrics["clipfrac_per_step"] = means[0] + means[1] + means[2]
        metrics["ratio_mean_per_step"] = means[3] + 1
        metrics["ratio_std_per_step"] = torch.addcmul(means[4], means[3], means[3], value=-1).clamp_min(0.0).sqrt()
        metrics["raw_ratio_mean_per_step"] = means[6] + 1
        metrics["raw_ratio_std_per_step"] = torch.addcmul(means[7], means[6], means[6], value=-1).clamp_min(0.0).sqrt()
        metrics["count_per_step"] = count_per_step
    return metrics
