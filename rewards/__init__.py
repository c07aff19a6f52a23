"""Reward models as callables `reward(images, prompts, **metadata) -> Tensor[B]`, selected by name.

`images` are `[B, 3, H, W]` floats in [0, 1]; the result is a float32 tensor `[B]` (NaN allowed: the trainer
drops and counts NaN rewards). `rewards.register(name)` adds a reward factory; `rewards.get(name, **kwargs)`
builds the reward (a registered name, or a dotted path `package.module:attribute` to your own callable or
factory); `rewards.list_rewards()` lists what is registered.

Built-in rewards (each in its own module, heavy imports deferred to construction): `jpeg_compressibility`,
`jpeg_incompressibility`, `aesthetic`, `clip_score`, `pickscore`, `hpsv2`, `imagereward`, `geneval` (GenEval's
rules over an object detector, `flowrl.rewards.geneval`), and `http` (a reward
served by `flowrl serve-reward`, see `flowrl.rewards.serving`). `MultiReward` combines several, `combine_advantages`
turns per-reward scores into advantages (`sum` or `gdpo`), `RewardExecutor` scores in a background thread. See
docs/rewards.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flowrl.registry import Registry, import_path


REWARDS: Registry = Registry("reward")


class RewardError(ValueError):
    """A reward returned something unusable (wrong shape, wrong type); the message names the reward."""


class RewardWeightsError(FileNotFoundError):
    """A reward model's weights (or tokenizer) could not be found; the message names the reward, the files it
    expects and how to provide them (a local folder/file argument, or a hub download command)."""


def register(name: str, factory: Callable[..., Any] | None = None, *, description: str | None = None):
    """Register a reward factory (a class or function whose call with kwargs returns the reward callable).

    Usable as a decorator: `@rewards.register("my_reward")`. The name is written once, here: a class gets it as its
    `name` attribute (what `Reward`'s error messages say); a class that sets another `name` itself is refused.
    """

    def add(item):
        if isinstance(item, type) and item.__dict__.get("name", name) != name:
            raise ValueError(
                f"reward class {item.__name__} sets name = {item.__dict__['name']!r} but is registered as {name!r}: "
                "drop its name attribute (the registration sets it)"
            )
        REWARDS.register(name, item, description=description)
        if isinstance(item, type):
            item.name = name
        return item

    return add if factory is None else add(factory)


def _import(path: str):
    return import_path(path, "reward")


def get(name: str, **kwargs: Any) -> Callable[..., Any]:
    """Build the reward `name` with `kwargs`.

    `name` is a registered reward or `package.module:attribute`. An attribute that is a class (or any
    factory) is called with `kwargs`; a plain function taking `(images, prompts, ...)` is used as is (kwargs
    must then be empty).
    """
    if ":" in name:
        target = _import(name)
        if isinstance(target, type) or kwargs:
            _check_kwargs(name, target, kwargs)
            return target(**kwargs)
        return target
    factory = REWARDS.get(name)
    _check_kwargs(name, factory, kwargs)
    return factory(**kwargs)


def _check_kwargs(name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Refuse, naming them and the arguments `factory` takes, keyword arguments it does not take (unless it takes
    `**kwargs`), before anything is built."""
    import inspect

    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the call says what is wrong
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    takes = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [key for key in kwargs if key not in takes]
    if unknown:
        raise ValueError(
            f"reward {name!r} takes no argument {', '.join(map(repr, unknown))}; its arguments: "
            f"{', '.join(takes) or 'none'}"
        )


def list_rewards() -> list[str]:
    """Names of the registered rewards."""
    return REWARDS.names()


def check_output(name: str, scores, batch_size: int) -> torch.Tensor:
    """`scores` as a float32 tensor `[B]` on the CPU, or a `RewardError` naming the reward.

    Accepts tensors, numpy arrays and lists; NaN values pass through (the trainer counts and drops them).
    """
    try:
        scores = torch.as_tensor(scores, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise RewardError(f"reward {name!r} returned {type(scores).__name__}, not numbers: {err}") from err
    scores = scores.detach().cpu()
    if scores.ndim == 2 and scores.shape[1] == 1:
        scores = scores[:, 0]
    if scores.shape != (batch_size,):
        raise RewardError(f"reward {name!r} returned shape {tuple(scores.shape)}; expected [{batch_size}]")
    return scores


# Every module of this package is imported here, so a built-in reward registers itself by being a module of it (a
# new reward is one file); heavy dependencies (transformers, open_clip, PIL) load only when a reward is constructed.
def _import_modules() -> None:
    import importlib
    import pkgutil

    for module in pkgutil.walk_packages(__path__, f"{__name__}."):  # and the modules of its packages (serving)
        importlib.import_module(module.name)


_import_modules()
from flowrl.rewards.multi import MultiReward, MultiRewardOutput, combine_advantages  # noqa: E402
from flowrl.rewards.scoring import Rewards  # noqa: E402
from flowrl.rewards.serving.executor import RewardExecutor  # noqa: E402


__all__ = [
    "REWARDS",
    "MultiReward",
    "MultiRewardOutput",
    "RewardError",
    "RewardExecutor",
    "RewardWeightsError",
    "Rewards",
    "check_output",
    "combine_advantages",
    "get",
    "list_rewards",
    "register",
]
