"""The trainer registry: each algorithm module registers its class, and so its config class, under one name.

The algorithms (`flowrl.trainers`, a layer above) fill it when imported; `load_config` reads a run config by it.
"""

from __future__ import annotations

from pathlib import Path

from flowrl.config import ConfigError, apply_overrides, from_dict, read_yaml
from flowrl.registry import Registry


TRAINERS: Registry = Registry("trainer")
"""Trainer name -> algorithm class (`Algorithm` subclass with its `config_class`)."""


def register(name: str, *, description: str | None = None):
    """Class decorator: register an algorithm as trainer `name`. The name is written once, here: it becomes the
    class's `name` and its config class's `trainer` default."""

    def add(cls):
        config = cls.config_class
        taken = config.__dict__.get("registered_name")
        if taken and taken != name:
            raise ValueError(
                f"{config.__name__} already belongs to trainer {taken!r}; give {name!r} a config class "
                "of its own (a subclass)"
            )
        TRAINERS.register(name, cls, description=description)
        cls.name = name
        config.registered_name = name
        return cls

    return add


def load_config(source: str | Path | dict, overrides: list[str] = (), config_class: type | None = None):
    """A trainer config from a YAML file (or dict) plus `section.key=value` overrides.

    The `trainer` key picks the config class among the registered trainers (import `flowrl.trainers` first: it
    registers them), unless `config_class` is given (a rollout worker's: the learner's own config class). Unknown
    keys, keys of earlier versions (the message names their new place) and invalid values fail with a
    `ConfigError` naming the key.
    """
    data = read_yaml(source) if not isinstance(source, dict) else dict(source)
    data = apply_overrides(data, list(overrides))
    name = data.get("trainer")
    if name is None:
        raise ConfigError(f"the config must name its trainer (trainer: one of {', '.join(TRAINERS.names())})")
    if config_class is None:
        if not TRAINERS.names():
            raise ConfigError("no trainer is registered: import flowrl.trainers (its modules register them)")
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
