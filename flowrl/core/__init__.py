"""The shared ratio-normalisation-and-clipping core: pure tensor functions over masked `[B, K]` tensors."""

import flowrl.core.humanline  # noqa: F401  (registers humanline)
import flowrl.core.troll  # noqa: F401  (registers troll)
from flowrl.core import (  # noqa: F401  (register the text-literature and preference objectives)
    llm_entropy_objectives,  # noqa: F401  (register Clip-Cov, KL-Cov, R2VPO, SSPO, ESPO, the 80/20 rule)
    llm_group_objectives,  # noqa: F401  (register TRPA, Reg-GRPO, GTPO, ST-PPO)
    llm_objectives,
    preference,
)
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
