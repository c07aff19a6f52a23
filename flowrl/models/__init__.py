"""Model families (adapters, options, tiny offline builders), loaders (hub id or local folder) and a run's `model`
section (the policy built from it: `flowrl.policies.build`)."""

from flowrl.models.config import ModelConfig
from flowrl.models.loaders import detect_family, families, load_pipeline
from flowrl.models.tiny import tiny_flux, tiny_pipeline, tiny_sd3, tiny_unet


__all__ = [
    "ModelConfig",
    "detect_family",
    "families",
    "load_pipeline",
    "tiny_flux",
    "tiny_pipeline",
    "tiny_sd3",
    "tiny_unet",
]
