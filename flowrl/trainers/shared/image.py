"""The image algorithms' base: rollouts of a diffusion policy, their denoising steps as the `[B, K]` elements.

`ImageAlgorithm` connects an algorithm to the image modality (`flowrl.image`): the collector samples with an
`ImageSampler` (or the algorithm's own `sampler()`), the evaluator starts from `evaluation_latents` when the algorithm
draws its own, and a batch's loss inputs are its trained steps' transition terms (`flowrl.image.steps.StepTerms`:
log-probs, GRPO-Guard's RatioNorm inputs, step weights, the KL to the reference).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from flowrl.core import get_objective
from flowrl.image import HasSteps, ImageModality
from flowrl.image.steps import StepTerms
from flowrl.run.algorithm import Algorithm
from flowrl.sections import HasKL


class ImageAlgorithm(Algorithm):
    """Base of the image algorithms; see the module docstring."""

    modality_class: ClassVar[type] = ImageModality
    image_scale = True
    element_calls = True
    requires_stochastic: ClassVar[bool] = True
    """Rollouts must have a stochastic step (log-ratio trainers); FIND and the flow-matching trainers train on any."""
    kl_to_reference: ClassVar[bool] = True
    """The `kl` regulariser compares with the reference policy (FIND's compares with the N(0, I) prior)."""
    time_kinds: ClassVar[tuple[str, ...]] = ("flow", "ddim")
    """The model time conventions it trains (`ModelAdapter.time_kind`): flow-matching (velocity) models, and DDIM
    noise-prediction models (UNets, SDXL) where its sampler has a DDIM form."""
    video: ClassVar[bool] = True
    """Whether it trains video families (False: an extra network of its own, a critic, reads image latents)."""
    edits: ClassVar[bool] = True
    """Whether it trains on editing prompt sets (prompts with source images; False: its sampler or conditioning
    takes text only)."""

    def __init__(self, config, modality, engine):
        super().__init__(config, modality, engine)
        adapter = getattr(self.policy, "adapter", None)
        kind = getattr(adapter, "time_kind", None)
        if kind is not None and kind not in self.time_kinds:
            raise ValueError(
                f"{config.trainer} needs a flow-matching (velocity) model; a {self.policy.family} "
                "model predicts noise (flowrl list models)"
            )
        if getattr(adapter, "video", False) and not self.video:
            raise ValueError(
                f"{config.trainer} trains image models only (its critic reads image latents); "
                f"{self.policy.family} makes videos (flowrl list models)"
            )
        prompts = getattr(modality, "train_prompts", None) or []
        if not self.edits and any(getattr(p, "images", ()) for p in prompts):
            raise ValueError(
                f"{config.trainer} does not train on editing prompts (rows with source images) yet; "
                "use grpo_guard, flow_grpo, loop, diffusion_nft, awm, ... (docs/models.md)"
            )
        if self.store_means and config.sampling.sampler == "cps":
            raise ValueError(
                f"objective {self.objective!r} reads Gaussian step log-probs and means (GRPO-Guard's "
                "RatioNorm, Flow-DPPO's step KL); with CPS use sampler cps_gaussian (cps keeps "
                "Flow-GRPO's -mean (x' - mu)^2 log-prob)"
            )
        kl = config.kl if self.kl_to_reference and isinstance(config, HasKL) else None
        steps = config.steps if isinstance(config, HasSteps) else None
        self.step_terms = StepTerms(self.policy, steps, kl, store_means=self.store_means, seed=config.run.seed)

    @property
    def store_means(self) -> bool:
        """Rollouts keep each step's behaviour mean when the objective needs it (GRPO-Guard's RatioNorm)."""
        return self.objective is not None and "mean_diff_sq" in get_objective(self.objective).required

    def needs_reference(self) -> bool:
        return self.kl_to_reference and super().needs_reference()

    # ------------------------------------------------------------------------------------------
    # the modality's parts
    # ------------------------------------------------------------------------------------------

    def sampler(self):
        """One sampling call: `(texts, generators, rows, epoch) -> DiffusionRollout`."""
        return self.modality.sampler(store_means=self.store_means, requires_stochastic=self.requires_stochastic)

    def collector(self):
        return self.modality.collector(self.sampler())

    evaluation_latents = None
    """`(texts, generator, height, width) -> latents` of evaluation samples (FIND), or None: the policy's noise."""

    def evaluator(self):
        return self.modality.evaluator(initial_latents=self.evaluation_latents)

    # ------------------------------------------------------------------------------------------
    # elements: the denoising steps
    # ------------------------------------------------------------------------------------------

    def num_elements(self, data) -> int:
        return data.num_steps

    def elements(self, batch, epoch: int):
        """`[B, k]` trained steps: `steps.selection` among the rollout's stochastic steps."""
        return self.step_terms.select(batch.data, batch.rows, batch.size, epoch), None

    def terms(self, batch, index: torch.Tensor):
        """The stored transitions at steps `index [b, c]` of the micro-batch (`StepTerms.terms`)."""
        return self.step_terms.terms(batch.data, index, self.epoch)
