"""The trainer registry: each algorithm module registers its class, and so its config class, under one name."""

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
            raise ValueError(f"{config.__name__} already belongs to trainer {taken!r}; give {name!r} a config class "
                             "of its own (a subclass)")  # fmt: skip
        TRAINERS.register(name, cls, description=description)
        cls.name = name
        config.registered_name = name
        return cls

    return add
