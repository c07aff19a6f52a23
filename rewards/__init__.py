"""Reward models as callables `reward(images, prompts, **metadata) -> Tensor[B]`, selected by name.

`rewards.register(name)` adds a reward factory; `rewards.get(name, **kwargs)` builds the reward;
`rewards.list_rewards()` lists what is registered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flowrl.registry import Registry


REWARDS: Registry = Registry("reward")


def register(name: str, factory: Callable[..., Any] | None = None, *, description: str | None = None):
    """Register a reward factory (a class or function whose call with kwargs returns the reward callable).

    Usable as a decorator: `@rewards.register("my_reward")`.
    """
    return REWARDS.register(name, factory, description=description)


def get(name: str, **kwargs: Any) -> Callable[..., Any]:
    """Build the reward registered under `name` with `kwargs`; unknown names raise `ValueError`."""
    return REWARDS.get(name)(**kwargs)


def list_rewards() -> list[str]:
    """Names of the registered rewards."""
    return REWARDS.names()
