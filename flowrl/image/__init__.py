"""The image modality: config sections, the sampler, the collector, the evaluator and the denoising steps' loss
inputs that image algorithms share."""

from flowrl.image.config import HasSteps, ImageConfig, ImageEvalConfig, SamplingConfig, StepConfig
from flowrl.image.modality import ImageModality, build_image_policy


__all__ = [
    "HasSteps",
    "ImageConfig",
    "ImageEvalConfig",
    "ImageModality",
    "SamplingConfig",
    "StepConfig",
    "build_image_policy",
]
