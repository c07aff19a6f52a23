"""The objective registry: what an objective is (a log-ratio estimator + a surrogate + defaults) and where the
objectives of `flowrl.core.objectives` (and of `flowrl.core.text`, `flowrl.core.preference`, ...) register themselves.

The surrogates, the log-ratio estimators and the presets live in `flowrl.core.objectives`; the entry point that
runs one, `compute_policy_loss`, in `flowrl.core.policy_loss`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from flowrl.core.aggregation import AGGREGATIONS
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

INPUTS = (
    "logp",
    "old_logp",
    "log_ratio",
    "mask",
    "fmask",
    "adv",
    "entropy",
    "segment_ids",
    "state",
    "topk_logp",
    "old_topk_logp",
)
"""Keyword parameters of a surrogate or log-ratio estimator that are inputs, not hyper-parameters: `logp`,
`old_logp` and the element `log_ratio` (`[B, K]`, detached, padding zeroed), `mask` (bool) and `fmask` (the same
as 0/1 floats of the compute dtype: sums over it are 10x faster on CPU than over bools), `adv` (estimators only),
and the extra inputs a caller
passes to `compute_policy_loss`: `entropy` (`[B, K]` token entropies), `segment_ids` (`[B, K]` integer segment
of each element: turns, sentences), `state` (the objective's controller state, a dict it updates) and
`topk_logp` / `old_topk_logp` (`[B, K, V]` log-probs of each element's next-token support under the current
policy, carrying the gradient, and under the behaviour policy: TROLL, `flowrl.core.text.troll`)."""

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
    `dL/dlogp [B, K]` from a full pass first (`flowrl.run.scheduler`)."""
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


def element_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token / per-step log-ratio `log pi_theta - log pi_old` (the identity)."""
    return log_ratio
