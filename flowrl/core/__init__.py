"""The shared ratio-normalisation-and-clipping core: pure tensor functions over masked `[B, K]` tensors.

Every module of this package (and of `flowrl.core.text`, the text-literature objectives) is imported here, so an
objective registers itself by being a module: a new objective is its own module plus its test.
"""

import importlib
import pkgutil

from flowrl.core.advantages import (
    ADVANTAGES,
    PerPromptStatTracker,
    SmoothAdvantageStandardizer,
    batch_advantages,
    gae,
    group_advantages,
    group_index,
    leave_one_out_advantages,
    normalize,
    raw_advantages,
)
from flowrl.core.aggregation import AGGREGATIONS, aggregate, aggregation_weights, masked_mean, masked_std
from flowrl.core.flow_dppo import flow_dppo_mask, gaussian_step_divergence
from flowrl.core.gardo import (
    RiskController,
    diversity_factor,
    nearest_peer_distance,
    rank_uncertainty,
    uncertainty_gate,
)
from flowrl.core.kl import (
    KL_ESTIMATORS,
    diag_gaussian_kl,
    gaussian_mean_kl,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    velocity_mse,
)
from flowrl.core.objectives import (
    IMAGE_SCALE,
    OBJECTIVES,
    Objective,
    Surrogate,
    compute_policy_loss,
    get_objective,
    list_objectives,
    register_objective,
)
from flowrl.core.ratios import (
    gaussian_log_prob,
    grpo_guard_log_ratio,
    ratio_norm_grpo_guard,
    sequence_log_ratio,
)
from flowrl.core.steps import (
    SDE_WINDOW_SCHEDULES,
    STEP_SELECTIONS,
    STEP_WEIGHTINGS,
    sde_window_at,
    select_steps,
    step_weights,
    steps_to_mask,
)


def _import_modules() -> None:
    """Import every module of `flowrl.core`, its subpackages' too: each objective module registers its objectives."""
    for module in pkgutil.walk_packages(__path__, f"{__name__}."):
        importlib.import_module(module.name)


_import_modules()

__all__ = [
    "ADVANTAGES",
    "IMAGE_SCALE",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "OBJECTIVES",
    "SDE_WINDOW_SCHEDULES",
    "STEP_SELECTIONS",
    "STEP_WEIGHTINGS",
    "Objective",
    "PerPromptStatTracker",
    "RiskController",
    "SmoothAdvantageStandardizer",
    "Surrogate",
    "aggregate",
    "aggregation_weights",
    "batch_advantages",
    "compute_policy_loss",
    "diag_gaussian_kl",
    "diversity_factor",
    "flow_dppo_mask",
    "gae",
    "gaussian_log_prob",
    "gaussian_mean_kl",
    "gaussian_step_divergence",
    "get_objective",
    "group_advantages",
    "group_index",
    "grpo_guard_log_ratio",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "leave_one_out_advantages",
    "list_objectives",
    "masked_mean",
    "masked_std",
    "nearest_peer_distance",
    "normalize",
    "ratio_norm_grpo_guard",
    "rank_uncertainty",
    "raw_advantages",
    "register_objective",
    "sde_window_at",
    "select_steps",
    "sequence_log_ratio",
    "step_weights",
    "steps_to_mask",
    "uncertainty_gate",
    "velocity_mse",
]
