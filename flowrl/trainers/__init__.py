"""Trainers: thin algorithm layers on one shared loop (`flowrl.trainers.base`) and one objective core.

Each trainer module registers its trainer in `TRAINERS` when imported; importing this package imports every
module of it, so a new trainer is one new file here. `load_config` reads a run config and picks the trainer's
config class from its `trainer` key.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

# the trainers register themselves on import
from flowrl.config import ConfigError, TrainerConfig, apply_overrides, from_dict, read_yaml
from flowrl.trainers.acflow import ACFlowConfig, ACFlowTrainer
from flowrl.trainers.base import Trainer
from flowrl.trainers.dpok import DPOKConfig, DPOKTrainer
from flowrl.trainers.find import FINDConfig, FINDTrainer
from flowrl.trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer
from flowrl.trainers.grpo_guard import GRPOGuardConfig, GRPOGuardTrainer
from flowrl.trainers.image import ImageTrainer
from flowrl.trainers.loop import LOOPConfig, LOOPTrainer
from flowrl.trainers.registry import TRAINERS


SHARED_MODULES = {"advantages", "base", "collect", "control", "evaluate", "image", "matching", "registry", "scoring",
                  "state", "update"}  # fmt: skip
"""The loop's parts; every other module of this package is a trainer and is imported (registered) here."""
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in SHARED_MODULES:
        importlib.import_module(f"{__name__}.{_module.name}")


def load_config(source: str | Path | dict, overrides: list[str] = ()) -> TrainerConfig:
    """A trainer config from a YAML file (or dict) plus `section.key=value` overrides.

    The `trainer` key picks the config class; unknown keys, keys of earlier versions (the message names their
    new place) and invalid values fail with a `ConfigError` naming the key.
    """
    data = read_yaml(source) if not isinstance(source, dict) else dict(source)
    data = apply_overrides(data, list(overrides))
    name = data.get("trainer")
    if name is None:
        raise ConfigError(f"the config must name its trainer (trainer: one of {', '.join(TRAINERS.names())})")
    try:
        config_class = TRAINERS.get(name).config_class
    except ValueError as err:
        raise ConfigError(f"trainer: {err}") from None
    return from_dict(config_class, data, renamed=config_class.renamed_keys())


def build_trainer(config: TrainerConfig, **kwargs) -> Trainer:
    """The trainer named by `config.trainer`, built from its config."""
    return TRAINERS.get(config.trainer)(config, **kwargs)


__all__ = [
    "TRAINERS",
    "ACFlowConfig",
    "ACFlowTrainer",
    "DPOKConfig",
    "DPOKTrainer",
    "FINDConfig",
    "FINDTrainer",
    "FlowGRPOConfig",
    "FlowGRPOTrainer",
    "GRPOGuardConfig",
    "GRPOGuardTrainer",
    "ImageTrainer",
    "LOOPConfig",
    "LOOPTrainer",
    "Trainer",
    "TrainerConfig",
    "build_trainer",
    "load_config",
]
