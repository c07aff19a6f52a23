"""Flow-GRPO (Liu et al. 2025, arXiv:2505.05470): GRPO on the per-step Gaussian policy of a flow-SDE sampler.

Per epoch: m prompts x k samples with the flow-SDE sampler (`sampling`), group-relative advantages of the
terminal reward (group mean, group or global std, clipped to +-5), then PPO-clip on each trained step's
log-ratio `log pi_theta(x_{t+1} | x_t) - log pi_old(...)` with the same advantage at every step, plus an
optional KL to the reference policy. Defaults follow Flow-GRPO's SD3.5 recipe (`config/grpo.py`): clip 1e-4,
global std (population), advantage clip 5, the first 99% of the steps (9 of 10), uniform step weights, the KL
in the code's form (the exact step KL times |dt|) when `kl.beta` > 0.

Any objective of the core trains here (`objective.name: gspo` uses the trajectory's geometric-mean ratio over
the trained steps, `sapo`, `cispo`, ...), with any advantage estimator (`advantage.estimator: per_prompt` is
DDPO's running per-prompt statistics) and any step selection and weighting.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flowrl.image import HasSteps, ImageConfig, StepConfig
from flowrl.image.steps import STEP_KL_FORMS
from flowrl.sections import AdvantageConfig, HasKL, HasObjective, KLConfig, ObjectiveConfig
from flowrl.trainers.image import ImageAlgorithm
from flowrl.trainers.registry import register


@dataclasses.dataclass
class FlowGRPOConfig(HasObjective, HasKL, HasSteps, ImageConfig):
    kl_forms: ClassVar[tuple[str, ...]] = STEP_KL_FORMS

    objective: ObjectiveConfig = dataclasses.field(default_factory=lambda: ObjectiveConfig(clip_eps_low=1e-4))
    """PPO-clip with Flow-GRPO's clip range 1e-4 (log-probs are means over SD3.5's 65,536 latent elements)."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(std="global", clip=5.0, unbiased=False)
    )
    """Group mean, one population std over the epoch (`global_std`), clipped to +-5."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(form="gaussian_dt"))
    """Off (beta 0); Flow-GRPO uses 0.04 for GenEval/OCR and 0.01 for PickScore, in its code's form."""
    steps: StepConfig = dataclasses.field(default_factory=StepConfig)
    """The first 99% of the stochastic steps, uniform weights."""


@register(
    "flow_grpo", description="Flow-GRPO: PPO-clip on flow-SDE step log-probs with group advantages (arXiv:2505.05470)"
)
class FlowGRPO(ImageAlgorithm):
    """Flow-GRPO; see the module docstring and `FlowGRPOConfig`. The step scoring and the KL are `ImageAlgorithm`'s;
    the objective, advantages and steps are the config's."""

    config_class = FlowGRPOConfig
