"""Flow-GRPO's trainer, the base of the flow-SDE step trainers: PPO-clip on each trained denoising step's log-ratio.

`flow_grpo` registers it as it is (`flowrl.trainers.image.flow_grpo`, where the method is described); LOOP, GRPO-Guard,
TempFlow-GRPO, Flow-DPPO, GARDO and the window trainers (MixGRPO, DanceGRPO, Flow-GRPO-Fast) are subclasses with
their own defaults, checks and hooks.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flowrl.image import HasSteps, ImageConfig, StepConfig
from flowrl.image.steps import STEP_KL_FORMS
from flowrl.sections import AdvantageConfig, HasGroupFilter, HasKL, HasObjective, KLConfig, ObjectiveConfig
from flowrl.trainers.shared.image import ImageAlgorithm


@dataclasses.dataclass
class FlowGRPOConfig(HasObjective, HasKL, HasSteps, HasGroupFilter, ImageConfig):
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


class FlowGRPO(ImageAlgorithm):
    """Flow-GRPO; see `flowrl.trainers.image.flow_grpo` and `FlowGRPOConfig`. The step scoring and the KL are
    `ImageAlgorithm`'s; the objective, advantages and steps are the config's."""

    config_class = FlowGRPOConfig
