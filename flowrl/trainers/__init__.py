"""Trainers: algorithms as small classes on one run driver, one engine and one update scheduler.

Every module of this package is imported here, so an algorithm registers itself by being a module of it (a new
trainer is one file plus its test). `load_config` reads a run config and picks the trainer's config class from its
`trainer` key; `build_trainer` assembles the run (`flowrl.trainers.driver.Trainer`).
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from flowrl.config import ConfigError, apply_overrides, from_dict, read_yaml
from flowrl.trainers.algorithm import Algorithm
from flowrl.trainers.driver import Trainer
from flowrl.trainers.registry import TRAINERS, register


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def load_config(source: str | Path | dict, overrides: list[str] = ()):
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
    try:
        return from_dict(config_class, data, renamed=config_class.renamed_keys(), absent=config_class.absent_keys())
    except ConfigError as err:
        raise ConfigError(
            str(err).replace(" does not apply here:", f" does not apply to trainer {name!r}:", 1)
        ) from None


def build_trainer(config, **kwargs) -> Trainer:
    """The run of `config.trainer` assembled from its config (`Trainer`)."""
    return Trainer(config, **kwargs)


__all__ = ["TRAINERS", "Algorithm", "Trainer", "build_trainer", "load_config", "register"]
