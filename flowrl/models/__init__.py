"""Model loaders (hub id or local folder) and tiny offline builders for tests."""

from flowrl.models.loaders import FAMILIES, detect_family, load_pipeline
from flowrl.models.tiny import tiny_flux, tiny_sd3, tiny_unet


__all__ = ["FAMILIES", "detect_family", "load_pipeline", "tiny_flux", "tiny_sd3", "tiny_unet"]
