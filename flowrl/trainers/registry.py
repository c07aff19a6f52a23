"""The trainer registry: each trainer module registers its trainer class under its config's name."""

from flowrl.registry import Registry


TRAINERS: Registry = Registry("trainer")
