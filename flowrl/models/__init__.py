"""Model families (adapters, options, tiny offline builders), loaders (hub id or local folder) and policies from a
run's `model` section."""

from flowrl.models.build import DTYPES, load_policy, prepare_training
from flowrl.models.config import ModelConfig
from flowrl.models.loaders import detect_family, families, load_pipeline
from flowrl.models.tiny import tiny_flux, tiny_pipeline, tiny_sd3, tiny_unet


__all__ = [
    "DTYPES",
    "ModelConfig",
    "detect_family",
    "families",
    "load_pipeline",
    "load_policy",
    "prepare_training",
    "tiny_flux",
    "tiny_pipeline",
    "tiny_sd3",
    "tiny_unet",
]
