"""Model loaders (hub id or local folder), tiny offline builders for tests, and policies from a run config."""

from flowrl.models.build import DTYPES, build_policy
from flowrl.models.loaders import detect_family, families, load_pipeline
from flowrl.models.tiny import tiny_flux, tiny_sd3, tiny_unet


__all__ = [
    "DTYPES",
    "build_policy",
    "detect_family",
    "families",
    "load_pipeline",
    "tiny_flux",
    "tiny_sd3",
    "tiny_unet",
]
