"""Policy objectives over masked `[B, K]` log-probs: one core for image denoising steps and text tokens.

Every objective is a pair of pure tensor functions:

1. a **log-ratio estimator** `x[B, K]` (differentiable): the token/step ratio `logp - old_logp`, the GSPO
   sequence ratio, or the GRPO-Guard normalised ratio;
2. a **surrogate** that, given `r = exp(x)` and the advantages, returns the per-element loss value `v` and
   its derivative `g = dv/dx` (the "value / gradient-weight" form, `reference/algorithms-llm.md` sec. 4.1).

`compute_policy_loss` assembles `l = v + g * (x - sg(x))`, which has value `v` and gradient `g * grad(x)`
exactly, so the trust-region logic runs once, without autograd, in fp32, and is the same code for every
modality. Each surrogate's docstring gives the published loss; the test-suite checks value and gradient
against a direct autograd implementation of that formula.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from flowrl.core.aggregation import AGGREGATIONS, aggregation_weights, linearised_loss
from flowrl.core.dist import gather_valid
from flowrl.core.masking import float_mask, greater, less, select_valid, select_valid_checked
from flowrl.core.ratios import LOG_RATIO_CLAMP, compute_dtype, grpo_guard_log_ratio, sequence_log_ratio
from flowrl.registry import Registry, first_line, unknown_name_error


RENAMED_HPARAMS = {
    "clip_eps": "clip_eps_low (flowrl's one name for a clip width; clip_eps_high for an asymmetric upper one)",
    "eps": "clip_eps_low (SPO's trust-region width)",
    "clip_log": "clip_eps_low (GMPO's clip, in log units)",
    "kl_coef": "beta (flowrl's one name for a KL weight)",
}
"""Hyper-parameter names of earlier versions and their one name now (clip widths, KL weights)."""

PER_STEP_METRICS_MAX_K = 64
"""Per-step ratio/clip metrics are returned when K is at most this (denoising steps, not tokens)."""

COMMON_HPARAMS = ("agg", "weights", "norm_len", "top_entropy_quantile", "diagnostics")

DIAGNOSTICS = ("full", "clip", "none")
"""What `compute_policy_loss` reports: every ratio statistic, the clip fractions only (trl's and verl's set), or
only the objective's own metrics."""

INPUTS = ("logp", "old_logp", "log_ratio", "mask", "fmask", "adv", "entropy", "segment_ids", "state", "topk_logp",
          "old_topk_logp")  # fmt: skip
"""Keyword parameters of a surrogate or log-ratio estimator that are inputs, not hyper-parameters: `logp`,
`old_logp` and the element `log_ratio` (`[B, K]`, detached, padding zeroed), `mask` (bool) and `fmask` (the same
as 0/1 floats of the compute dtype: sums over it are 10x faster on CPU than over bools), `adv` (estimators only),
and the extra inputs a caller
passes to `compute_policy_loss`: `entropy` (`[B, K]` token entropies), `segment_ids` (`[B, K]` integer segment
of each element: turns, sentences), `state` (the objective's controller state, a dict it updates) and
`topk_logp` / `old_topk_logp` (`[B, K, V]` log-probs of each element's next-token support under the current
policy, carrying the gradient, and under the behaviour policy: TROLL, `flowrl.core.troll`)."""

EXTRA_INPUTS = ("entropy", "segment_ids", "state", "topk_logp", "old_topk_logp")


class LogRatio(NamedTuple):
    """What a log-ratio estimator may return instead of a bare `x [B, K]`: `x` with a differentiable per-element
    `penalty [B, K]` added to the loss before aggregation (TROLL's regression to its projection), and scalar
    `metrics` of its own."""

    value: torch.Tensor
    penalty: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] | None = None


class Surrogate(NamedTuple):
    """Per-element output of a surrogate.

    Attributes:
        value (`torch.Tensor`): loss value `v[B, K]` (to be minimised).
        coef (`torch.Tensor`): `dv/dx[B, K]`, the derivative with respect to the log-ratio.
        clipped_high (`torch.Tensor` or `None`): `[B, K]`, the upper trust-region bound is binding (bool, or a
            float 0/1 indicator, which long token batches compute 3x faster on CPU; `None`: never binds).
        clipped_low (`torch.Tensor` or `None`): `[B, K]`, the lower trust-region bound is binding (as above).
        clipped_dual (`torch.Tensor`, *optional*): `[B, K]`, the dual clip's cap is binding (A < 0, r > c).
            The three are disjoint, so `clipfrac = clipfrac_high + clipfrac_low + clipfrac_dual`.
        metrics (`dict`, *optional*): scalar diagnostics of the objective itself (BAPO's bounds, R2VPO's lambda).
    """

    value: torch.Tensor
    coef: torch.Tensor
    clipped_high: torch.Tensor | None
    clipped_low: torch.Tensor | None
    clipped_dual: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class Objective:
    """A registered objective: log-ratio estimator + surrogate + default aggregation and hyper-parameters."""

    name: str
    surrogate: Callable[..., Surrogate]
    log_ratio: Callable[..., torch.Tensor]
    agg: str
    description: str
    hparams: dict[str, Any] = field(default_factory=dict)
    """Hyper-parameter defaults (from the surrogate's and estimator's keyword-only parameters)."""
    required: tuple[str, ...] = ()
    """Hyper-parameters without a default that the caller must pass."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Defaults this preset changes relative to its surrogate's own defaults."""
    ratio_params: tuple[str, ...] = ()
    """Hyper-parameters the log-ratio estimator takes (cached at registration)."""
    surrogate_params: tuple[str, ...] = ()
    """Hyper-parameters the surrogate takes (cached at registration)."""
    needs_logp: bool = False
    """Whether the surrogate's value depends on `log pi_theta` itself (CISPO), not only on the ratio."""
    image_hparams: dict[str, Any] = field(default_factory=dict)
    """Defaults for image policies, whose log-probs are means over latent elements (see `register_objective`);
    image trainers use them for every hyper-parameter the user does not set."""
    elementwise: bool = True
    """Whether each element's loss depends on that element's inputs alone (PPO, GRPO-Guard). False when the
    log-ratio couples the K axis (GSPO's sequence ratio): a loop that splits K must then fix the coefficients
    `dL/dlogp [B, K]` from a full pass first (`flowrl.trainers.update`)."""
    surrogate_inputs: tuple[str, ...] = ()
    """Inputs (`INPUTS`) the surrogate takes."""
    ratio_inputs: tuple[str, ...] = ()
    """Inputs (`INPUTS`) the log-ratio estimator takes."""
    init_state: Callable[[], dict] | None = None
    """A stateful objective's initial controller state (R2VPO's dual variable); None: stateless."""
    batch_statistics: bool = False
    """Whether the loss uses statistics of the whole batch, summed or gathered over the processes on every call
    (BAPO's contribution sums, Clip-Cov's covariance, R2VPO's ratio variance): every process must then call it
    once per minibatch of the global batch, in step (see `uses_batch_statistics`)."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The extra inputs (`entropy`, `segment_ids`, `state`) a caller must pass to `compute_policy_loss`."""
        wanted = {*self.surrogate_inputs, *self.ratio_inputs}
        if self.hparams.get("top_entropy_quantile") is not None:
            wanted.add("entropy")
        return tuple(k for k in EXTRA_INPUTS if k in wanted)


OBJECTIVES: Registry[Objective] = Registry("objective")


def _keyword_params(fn: Callable) -> dict[str, Any]:
    """Keyword-only parameters of `fn` -> default (`inspect.Parameter.empty` when required)."""
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


def _split_inputs(params: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """`(inputs, hyper-parameters)` of a surrogate's or estimator's keyword parameters."""
    return tuple(k for k in params if k in INPUTS), {k: v for k, v in params.items() if k not in INPUTS}


def register_objective(
    name: str,
    surrogate: Callable[..., Surrogate],
    *,
    log_ratio: Callable[..., torch.Tensor] | None = None,
    agg: str = "token_mean",
    description: str | None = None,
    elementwise: bool | None = None,
    image: dict[str, Any] | None = None,
    init_state: Callable[[], dict] | None = None,
    batch_statistics: bool = False,
    **overrides: Any,
) -> Objective:
    """Register an objective under `name`.

    Args:
        name (`str`): registry name; a duplicate raises `ValueError`.
        surrogate (`Callable`): `fn(ratio, adv, *, logp, **hparams) -> Surrogate`; its keyword-only
            parameters (other than `logp`) are the objective's hyper-parameters.
        log_ratio (`Callable`, *optional*): `fn(log_ratio, mask, *, **hparams) -> [B, K]` mapping the masked
            element log-ratio `logp - old_logp` to the one the surrogate uses; defaults to the identity.
        agg (`str`, defaults to `"token_mean"`): default aggregation (see `flowrl.core.aggregation`).
        description (`str`, *optional*): one line for `flowrl list`; defaults to the surrogate's docstring.
        elementwise (`bool`, *optional*): whether element `(i, t)`'s loss depends on element `(i, t)`'s inputs
            only; defaults to True for the identity log-ratio and False for any other estimator.
        image (`dict`, *optional*): image-scale defaults. An image policy's per-step log-prob is a mean over its
            D latent elements, so its ratios sit far closer to 1 than a token's: trust-region widths shrink and
            temperatures grow by the factor that maps PPO's text clip 0.2 to Flow-GRPO's image clip 1e-4
            (SD3.5 at 512 px), `IMAGE_SCALE` = 5e-4. Hyper-parameters not listed keep their defaults.
        init_state (`Callable`, *optional*): the initial controller state of a stateful objective; the caller
            keeps it, passes it as `state=` on every call and checkpoints it.
        batch_statistics (`bool`, defaults to False): the loss reads statistics of the whole batch, reduced over
            the processes inside the call (`flowrl.core.dist`); implies `elementwise=False`.
        **overrides: hyper-parameter defaults that differ from the surrogate's (presets such as `dapo`).

    Keyword parameters named in `INPUTS` (`logp`, `entropy`, `segment_ids`, `state`, ...) are inputs, not
    hyper-parameters; `Objective.inputs` lists the extra ones a caller must pass.
    """
    if agg not in AGGREGATIONS:
        raise unknown_name_error("aggregation", agg, list(AGGREGATIONS))
    if batch_statistics and elementwise:
        raise ValueError(f"objective {name!r} reads batch statistics, so it cannot be element-wise")
    if elementwise is None:
        elementwise = not batch_statistics and (log_ratio is None or log_ratio is element_log_ratio)
    log_ratio = log_ratio or element_log_ratio
    surrogate_inputs, surrogate_params = _split_inputs(_keyword_params(surrogate))
    needs_logp = "logp" in surrogate_inputs
    ratio_inputs, ratio_params = _split_inputs(_keyword_params(log_ratio))
    if "state" in (*surrogate_inputs, *ratio_inputs) and init_state is None:
        raise ValueError(f"objective {name!r} takes a state: register it with init_state")
    params = {**surrogate_params, **ratio_params}
    for key in overrides:
        if key not in params and key != "top_entropy_quantile":
            raise unknown_name_error("hyper-parameter", key, list(params), where=f"for objective {name!r}")
    params.update(overrides)
    for key in image or {}:
        if key not in params:
            raise unknown_name_error("hyper-parameter", key, list(params), where=f"for objective {name!r} (image)")
    required = tuple(k for k, v in params.items() if v is inspect.Parameter.empty)
    defaults = {k: v for k, v in params.items() if v is not inspect.Parameter.empty}
    objective = Objective(
        name=name,
        surrogate=surrogate,
        log_ratio=log_ratio,
        agg=agg,
        description=description or first_line(surrogate.__doc__),
        hparams=defaults,
        required=required,
        overrides=dict(overrides),
        ratio_params=tuple(ratio_params),
        surrogate_params=tuple(surrogate_params),
        needs_logp=needs_logp,
        image_hparams=dict(image or {}),
        elementwise=elementwise,
        surrogate_inputs=surrogate_inputs,
        ratio_inputs=ratio_inputs,
        init_state=init_state,
        batch_statistics=batch_statistics,
    )
    OBJECTIVES.register(name, objective, description=objective.description)
    return objective


def uses_batch_statistics(objective: Objective | None, hparams: dict | None = None) -> bool:
    """Whether a call of `objective` with `hparams` reduces over the global batch (`Objective.batch_statistics`,
    or a `top_entropy_quantile` selection): its loss couples every element of the minibatch, and with several
    processes each must make the same calls."""
    if objective is None:
        return False
    rho = (hparams or {}).get("top_entropy_quantile", objective.hparams.get("top_entropy_quantile"))
    return objective.batch_statistics or rho is not None


def list_objectives() -> list[str]:
    """Names of the registered objectives."""
    return OBJECTIVES.names()


def get_objective(name: str) -> Objective:
    """The registered `Objective` called `name` (raises `ValueError` listing the valid names)."""
    return OBJECTIVES.get(name)


# ----------------------------------------------------------------------------------------------
# log-ratio estimators: (masked element log-ratio, mask) -> x[B, K], differentiable through logp
# ----------------------------------------------------------------------------------------------


def element_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token / per-step log-ratio `log pi_theta - log pi_old` (the identity)."""
    return log_ratio


def gspo_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO sequence log-ratio (geometric mean over the valid elements), broadcast to `[B, K]`."""
    return sequence_log_ratio(log_ratio, mask)


def guard_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, *, std, mean_diff_sq) -> torch.Tensor:
    """GRPO-Guard normalised per-step log-ratio `s * (l + ||dmu||^2 / (2 s^2))`."""
    dtype, device = log_ratio.dtype, log_ratio.device
    std = torch.as_tensor(std, dtype=dtype, device=device).expand_as(log_ratio)
    mean_diff_sq = torch.as_tensor(mean_diff_sq, device=device).to(dtype).expand_as(log_ratio)
    # untrained steps may be deterministic (std 0): give them std 1 so no 0/0 reaches the gradient
    std = torch.where(mask, std, 1.0)
    mean_diff_sq = torch.where(mask, mean_diff_sq, 0.0)
    return grpo_guard_log_ratio(log_ratio, std, mean_diff_sq)


# ----------------------------------------------------------------------------------------------
# surrogates: (ratio, adv) -> Surrogate(value, d value / d log_ratio, clipped_high, clipped_low)
# ----------------------------------------------------------------------------------------------


def _dual_clip(value, coef, adv, dual_clip_c):
    """Dual clip (Ye et al. 2020, arXiv:1912.09729): for A < 0, `l = min(l, -A * c)`, gradient 0 there."""
    if dual_clip_c is None:
        return value, coef, None
    if dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    capped = (adv < 0) & (value > -adv * dual_clip_c)  # [B, K]
    value = torch.where(capped, -adv * dual_clip_c, value)
    coef = torch.where(capped, 0.0, coef)
    return value, coef, capped


def _bounds(clip_eps_low: float, clip_eps_high: float | None) -> tuple[float, float]:
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if clip_eps_low < 0 or high < 0:
        raise ValueError(f"clip ranges must be >= 0, got clip_eps_low={clip_eps_low}, clip_eps_high={high}")
    return 1.0 - clip_eps_low, 1.0 + high


def _clip_between(ratio, adv, low, high, dual_clip_c=None) -> Surrogate:
    """PPO-clip with absolute bounds `low < 1 < high` (scalars or `[B, K]` tensors) and an optional dual clip."""
    unclipped = -adv * ratio  # [B, K]
    # a bound binds where the clipped branch is strictly the max: A > 0 above 1+eps_h, A < 0 below 1-eps_l
    # (at the bound itself the branches tie and the gradient is kept, as autograd does); float 0/1 flags
    clipped_high = greater(ratio, high) * greater(adv, 0.0)  # [B, K]
    clipped_low = less(ratio, low) * less(adv, 0.0)  # [B, K]
    # max(-A r, -A clip(r)) is the clipped branch exactly where a bound binds, the unclipped one elsewhere
    value = torch.maximum(unclipped, -adv * ratio.clamp(low, high))
    coef = unclipped * (1 - (clipped_high + clipped_low))  # dl/dlog r = -A r on the unclipped branch, else 0
    value, coef, dual = _dual_clip(value, coef, adv, dual_clip_c)
    return Surrogate(value, coef, clipped_high, clipped_low, dual)


def ppo_clip(ratio, adv, *, clip_eps_low: float = 0.2, clip_eps_high: float | None = None, dual_clip_c=None):
    """PPO-clip, asymmetric bounds, optional dual clip (Schulman et al. 2017, arXiv:1707.06347 eq. 7).

    `l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`; `clip_eps_high` defaults to `clip_eps_low`
    (clip-higher: DAPO, arXiv:2503.14476 sec. 3.1); with `dual_clip_c` = c, `l = min(l, -A c)` for A < 0.
    Gradient `dl/dlog r = -A r` where the unclipped branch is active, 0 where a bound binds.
    """
    return _clip_between(ratio, adv, *_bounds(clip_eps_low, clip_eps_high), dual_clip_c)


def gppo(
    ratio,
    adv,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = 0.28,
    beta_low: float = 1.0,
    beta_high: float = 1.0,
    dual_clip_c=None,
):
    """Gradient-preserving clip: PPO's value, bounded gradient when clipped (GPPO arXiv:2508.07629, CE-GPPO).

    `l = max(-A r, -A clip(r, (1-eps_l) r/sg(r), (1+eps_h) r/sg(r)))`; in the two clipped regions the
    value is `-beta_l (1-eps_l) A` (A<0, r<1-eps_l) or `-beta_h (1+eps_h) A` (A>0, r>1+eps_h) and the
    gradient is that same number (CE-GPPO, arXiv:2509.20712). With beta = 1 the value equals
    clip-higher PPO on every input; elsewhere the gradient equals PPO's.
    """
    low, high = _bounds(clip_eps_low, clip_eps_high)
    unclipped = -adv * ratio  # [B, K]
    clipped_high = (adv > 0) & (ratio > high)
    clipped_low = (adv < 0) & (ratio < low)
    preserved_high = -beta_high * high * adv  # value and d/dlog r of -beta_h (1+eps_h) A r/sg(r)
    preserved_low = -beta_low * low * adv
    value = torch.where(clipped_high, preserved_high, torch.where(clipped_low, preserved_low, unclipped))
    coef = value.clone()  # in every region the value is linear in r / sg(r), so d/dlog r = value
    value, coef, dual = _dual_clip(value, coef, adv, dual_clip_c)
    return Surrogate(value, coef, clipped_high, clipped_low, dual)


def clamp(ratio, adv, *, clip_eps_low: float = 1e-4, clip_eps_high: float | None = None):
    """Clamp-only ratio (DPOK arXiv:2305.16381 as released; FIND arXiv:2407.19453): `l = -A clamp(r, 1-eps, 1+eps)`.

    Stricter than PPO: the gradient `-A r` flows only while `1-eps_low < r < 1+eps_high`, for both signs of A.
    `clip_eps_high` defaults to `clip_eps_low` (DPOK and FIND clamp symmetrically: 1e-4 and 0.2).
    """
    low, high = _bounds(clip_eps_low, clip_eps_high)
    value = -adv * ratio.clamp(low, high)  # [B, K]
    above, below = ratio > high, ratio < low
    coef = torch.where(above | below, 0.0, -adv * ratio)
    return Surrogate(value, coef, above, below)


def reinforce(ratio, adv):
    """Unclipped importance-weighted policy gradient `l = -A r` (REINFORCE / A2C as PPO, arXiv:2205.09123).

    At `r = 1` (one update per rollout) the gradient is exactly `-A grad(log pi)`.
    """
    value = -adv * ratio  # [B, K]
    return Surrogate(value, value, None, None)


def spo(ratio, adv, *, clip_eps_low: float = 0.2):
    """Quadratic-penalty surrogate (SPO, Xie et al. 2025, arXiv:2401.16025).

    `l = -(A r - |A| (r - 1)^2 / (2 eps))`, maximised at `r* = 1 + sign(A) eps` (`eps` = `clip_eps_low`, the trust
    region's width, flowrl's one name for it); the gradient `dl/dlog r = (-A + |A| (r - 1) / eps) r` is never
    zeroed, it pulls r back inside the trust region.
    """
    eps = clip_eps_low
    if eps <= 0:
        raise ValueError(f"clip_eps_low must be > 0, got {eps}")
    value = -(adv * ratio - adv.abs() * (ratio - 1) ** 2 / (2 * eps))  # [B, K]
    coef = (-adv + adv.abs() * (ratio - 1) / eps) * ratio
    # report where PPO's bound would bind, for comparability of the clip-fraction metric
    beyond_high, beyond_low = (adv > 0) & (ratio > 1 + eps), (adv < 0) & (ratio < 1 - eps)
    return Surrogate(value, coef, beyond_high, beyond_low)


def ppo_spo(ratio, adv, *, clip_eps_low: float = 0.2):
    """Asymmetric trust region of FPO++ ("ASPO", Yi et al. 2026, arXiv:2602.02481 eq. 11-12).

    PPO-clip where `A >= 0`; SPO's penalty `l = -(A r - |A| (r - 1)^2 / (2 eps))` where `A < 0`, with the same
    `eps` on both sides: a negative advantage pulls the ratio back toward 1 instead of pushing the flow's
    likelihood of a bad action down without bound.
    """
    pos = (adv >= 0).expand_as(ratio)  # [B, K]
    clipped, penalised = ppo_clip(ratio, adv, clip_eps_low=clip_eps_low), spo(ratio, adv, clip_eps_low=clip_eps_low)
    value = torch.where(pos, clipped.value, penalised.value)
    coef = torch.where(pos, clipped.coef, penalised.coef)
    return Surrogate(value, coef, pos & clipped.clipped_high.bool(), ~pos & penalised.clipped_low)


def sapo(ratio, adv, *, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """Soft adaptive gate instead of a clip (SAPO, arXiv:2511.20347).

    `l = -A (4/tau) sigmoid(tau (r - 1))` with `tau = tau_pos` for A > 0 and `tau_neg` otherwise;
    gradient `dl/dlog r = -A 4 sigma (1 - sigma) r`, which equals `-A` at r = 1 and decays smoothly.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    tau = torch.full_like(adv, tau_neg).masked_fill_(adv > 0, tau_pos)  # adv's shape: [B, 1] or [B, K]
    gate = torch.addcmul(-tau, tau, ratio).sigmoid_()  # [B, K] sigmoid(tau (r - 1)), one pass and one buffer
    scale = adv * -4.0  # -4 A
    value = gate * (scale / tau)
    coef = torch.addcmul(gate, gate, gate, value=-1.0).mul_(ratio).mul_(scale)  # -4 A sigma (1 - sigma) r
    return Surrogate(value, coef, None, None)


def cispo(ratio, adv, *, logp, clip_eps_low: float | None = None, clip_eps_high: float = 4.0):
    """Clipped IS-weight REINFORCE (CISPO, MiniMax-M1, arXiv:2506.13585 sec. 3.1).

    `l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta`: the truncated weight is a constant, so
    clipped elements still get gradient `-A w`. `clip_eps_high` means `1 + eps` (verl's convention; trl's
    `epsilon_high` is the absolute cap `1 + eps`); the default cap 5 is the one trl's docs recommend
    (ScaleRL, arXiv:2510.13786). No lower bound unless `clip_eps_low` is given. The value depends on
    `log pi_theta` itself, not only on the ratio.
    """
    low = 0.0 if clip_eps_low is None else 1.0 - clip_eps_low
    high = 1.0 + clip_eps_high
    weight = ratio.clamp(low, high)  # [B, K]
    coef = -adv * weight  # dl/dlogp = -A w: the weight is a constant
    value = coef * logp  # -sg(w) A log pi_theta
    return Surrogate(value, coef, greater(ratio, high), None if clip_eps_low is None else less(ratio, low))


# ----------------------------------------------------------------------------------------------
# the registry: presets pin the published defaults
# ----------------------------------------------------------------------------------------------

IMAGE_SCALE = 5e-4
"""Trust-region scale of image policies: Flow-GRPO's clip range 1e-4 for SD3.5 at 512 px (element-mean log-probs
over 65,536 latent elements) over PPO's 0.2 for tokens. Image defaults multiply widths by it and divide
temperatures by it. Other latent sizes move a range by `flowrl.core.ratios.clip_for_latent_size` (`sqrt(65536 / D)`):
the digits world (64 pixels) by 32x; its Flow-GRPO-family recipes clip at 1e-3 (10x, tuned), GRPO-Guard's at the
rule's 6.4e-5."""

_IMAGE_CLIP = 0.2 * IMAGE_SCALE  # 1e-4

register_objective("ppo", ppo_clip, agg="token_mean", image={"clip_eps_low": _IMAGE_CLIP})
register_objective(
    "grpo",
    ppo_clip,
    agg="seq_mean_token_mean",
    description="GRPO: PPO-clip (eps 0.2) averaged per sequence then over sequences (arXiv:2402.03300 eq. 3)",
    image={"clip_eps_low": _IMAGE_CLIP},
)
register_objective(
    "dapo",
    ppo_clip,
    agg="token_mean",
    clip_eps_high=0.28,
    description="DAPO: clip-higher PPO (eps 0.2 / 0.28) with token-mean aggregation (arXiv:2503.14476 sec. 3.1, 3.3)",
    image={"clip_eps_low": _IMAGE_CLIP, "clip_eps_high": 0.28 * IMAGE_SCALE},
)
register_objective(
    "dr_grpo",
    ppo_clip,
    agg="seq_mean_token_sum_norm",
    description="Dr.GRPO: PPO-clip summed per sequence over a constant length L (arXiv:2503.20783 sec. 3)",
    image={"clip_eps_low": _IMAGE_CLIP},
)
register_objective(
    "gspo",
    ppo_clip,
    log_ratio=gspo_log_ratio,
    elementwise=False,
    agg="seq_mean_token_mean",
    clip_eps_low=3e-4,
    clip_eps_high=4e-4,
    description="GSPO: PPO-clip on the sequence geometric-mean ratio (images: over trained steps) (arXiv:2507.18071)",
    # an image trajectory's log-ratio is the mean of ~10 per-step log-ratios with independent noise: its spread is
    # about 1/3 of a step's, so a third of the per-step image clip, with GSPO's 3:4 asymmetry
    image={"clip_eps_low": 3e-5, "clip_eps_high": 4e-5},
)
register_objective("sapo", sapo, agg="seq_mean_token_mean",
                   image={"tau_pos": 1.0 / IMAGE_SCALE, "tau_neg": 1.05 / IMAGE_SCALE})  # fmt: skip
register_objective("cispo", cispo, agg="token_mean", image={"clip_eps_high": 4.0 * IMAGE_SCALE})
register_objective("spo", spo, agg="token_mean", image={"clip_eps_low": 0.2 * IMAGE_SCALE})
register_objective("gppo", gppo, agg="token_mean",
                   image={"clip_eps_low": _IMAGE_CLIP, "clip_eps_high": 0.28 * IMAGE_SCALE})  # fmt: skip
register_objective("ppo_spo", ppo_spo, agg="token_mean", image={"clip_eps_low": _IMAGE_CLIP})
register_objective("clamp", clamp, agg="token_mean", image={"clip_eps_low": _IMAGE_CLIP})
register_objective("reinforce", reinforce, agg="token_mean")
register_objective(
    "grpo_guard",
    ppo_clip,
    log_ratio=guard_log_ratio,
    elementwise=True,
    agg="token_mean",
    clip_eps_low=2e-6,
    description="GRPO-Guard: PPO-clip (eps 2e-6) on the RatioNorm-ed per-step log-ratio (arXiv:2510.22319 sec. 3)",
    image={"clip_eps_low": 2e-6},
)


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
            the objectives whose `inputs` name them (TROLL, `flowrl.core.troll`).
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
    given = {"entropy": entropy, "segment_ids": segment_ids, "state": state, "topk_logp": topk_logp,
             "old_topk_logp": old_topk_logp}  # fmt: skip
    wanted = [*objective.inputs, *(["entropy"] if top_entropy is not None else [])]
    for key in wanted:
        if given[key] is None:
            what = {"entropy": "per-element entropies [B, K]", "segment_ids": "per-element segment ids [B, K]",
                    "state": f"its controller state (get_objective({name!r}).init_state())",
                    "topk_logp": "the current policy's support log-probs [B, K, V]",
                    "old_topk_logp": "the behaviour policy's support log-probs [B, K, V]"}[key]  # fmt: skip
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
    x = objective.log_ratio(log_ratio, mask, **{k: hp[k] for k in objective.ratio_params},
                            **{k: inputs[k] for k in objective.ratio_inputs})  # [B, K]  # fmt: skip
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
    fracs = [zero if f is None else torch.dot(float_mask(f, weight.dtype).reshape(-1), weight.reshape(-1)) / count
             for f in terms[2:5]]  # fmt: skip
    return {"clipfrac": fracs[0] + fracs[1] + fracs[2], "clipfrac_high": fracs[0], "clipfrac_low": fracs[1],
            "clipfrac_dual": fracs[2]}  # fmt: skip


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
