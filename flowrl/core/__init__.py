"""The shared ratio-normalisation-and-clipping core: pure tensor functions over masked `[B, K]` tensors."""

from flowrl.core import llm_objectives  # noqa: F401  (registers the text-literature objectives)
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
    STEP_SELECTIONS,
    STEP_WEIGHTINGS,
    select_steps,
    step_weights,
    steps_to_mask,
)


__all__ = [
    "ADVANTAGES",
    "IMAGE_SCALE",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "OBJECTIVES",
    "STEP_SELECTIONS",
    "STEP_WEIGHTINGS",
    "Objective",
    "PerPromptStatTracker",
    "SmoothAdvantageStandardizer",
    "Surrogate",
    "aggregate",
    "aggregation_weights",
    "batch_advantages",
    "compute_policy_loss",
    "diag_gaussian_kl",
    "gae",
    "gaussian_log_prob",
    "gaussian_mean_kl",
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
    "normalize",
    "ratio_norm_grpo_guard",
    "raw_advantages",
    "register_objective",
    "select_steps",
    "sequence_log_ratio",
    "step_weights",
    "steps_to_mask",
    "velocity_mse",
]
