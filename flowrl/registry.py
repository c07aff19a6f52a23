"""Name registries for the places where users pick an algorithm piece by name.

One `Registry` per seam (objectives, advantage estimators, KL estimators, step selections,
step weightings, samplers, rewards, trainers). Registering a name twice raises; asking for an
unknown name raises a `ValueError` that lists the valid names and the closest matches.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar


T = TypeVar("T")


def first_line(doc: str | None) -> str:
    """The first non-empty line of a docstring ('' when there is none)."""
    for line in inspect.cleandoc(doc or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def unknown_name_error(kind: str, name: object, valid: list[str], where: str = "") -> ValueError:
    """A `ValueError` for an unknown `name` that lists every valid choice and the close ones.

    `where` adds context, e.g. `"for objective 'ppo'"`.
    """
    close = difflib.get_close_matches(str(name), valid, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    where = f" {where}" if where else ""
    choices = ", ".join(valid) or "(none registered)"
    return ValueError(f"unknown {kind} {name!r}{where}.{hint} Valid choices: {choices}.")


def import_path(path: str, kind: str) -> Any:
    """The attribute a `package.module:attribute` path names; a one-line `ValueError` naming `kind` otherwise."""
    import importlib

    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"a {kind} path must look like 'package.module:attribute', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} for {kind} {path!r}: {err}") from err
    if not hasattr(module, attribute):
        raise ValueError(f"module {module_name!r} has no attribute {attribute!r} ({kind} {path!r})")
    return getattr(module, attribute)


class Registry(Generic[T]):
    """A mapping from names to objects with a one-line description each.

    Args:
        kind (`str`): what the registry holds, used in error messages ("objective", "reward", ...).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._descriptions: dict[str, str] = {}

    def register(self, name: str, obj: T | None = None, *, description: str | None = None) -> Any:
        """Register `obj` under `name`; without `obj`, return a decorator that registers its argument.

        The description defaults to the first line of the object's docstring.
        """

        def add(item: T) -> T:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered; pick another name")
            self._items[name] = item
            self._descriptions[name] = description if description is not None else first_line(item.__doc__)
            return item

        return add if obj is None else add(obj)

    def unregister(self, name: str) -> None:
        """Remove `name` (for tests and for users replacing their own entries)."""
        if name not in self._items:
            raise unknown_name_error(self.kind, name, self.names())
        del self._items[name]
        del self._descriptions[name]

    def get(self, name: str) -> T:
        """The object registered under `name`; raises `ValueError` listing the valid names."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise unknown_name_error(self.kind, name, self.names()) from None

    def resolve(self, name: str) -> T:
        """`get(name)`, or the object a `package.module:attribute` path names (a user's own entry)."""
        if isinstance(name, str) and ":" in name:
            return import_path(name, self.kind)
        return self.get(name)

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._items)

    def describe(self) -> dict[str, str]:
        """Name -> one-line description."""
        return dict(self._descriptions)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def check_kwargs(kind: str, name: str, given: dict[str, Any], fn: Callable) -> None:
    """Raise a `ValueError` if `given` holds a keyword that `fn` does not accept."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [p for p, v in params.items() if v.kind in (v.KEYWORD_ONLY, v.POSITIONAL_OR_KEYWORD)]
    for key in given:
        if key not in valid:
            raise unknown_name_error("hyper-parameter", key, valid, where=f"for {kind} {name!r}")
