"""Module paths that moved: importing an old path warns (`DeprecationWarning`) and gives the new module itself.

`MOVED` is the one table of old module path -> new module path; a module (or package) that moves adds its row here.
The finder is installed on `sys.meta_path` when `flowrl` is imported, so an old path such as
`flowrl.trainers.driver` imports as `flowrl.run.driver`: the same module object, in `sys.modules` under both names,
so code, checkpoints and pickles that name an old path still load. A row of a package covers its submodules
(`old.sub` is `new.sub`). An old path must not be a module of its own any more (`tests/test_moved.py`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings


MOVED: dict[str, str] = {}
"""Old module path -> the module it is now (old paths keep working, with a `DeprecationWarning`)."""


def new_path(name: str) -> str | None:
    """The module `name` (an old path, or a submodule of an old package path) is now; None if it did not move."""
    for old in sorted(MOVED, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            return MOVED[old] + name[len(old) :]
    return None


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED` and loads each as its new module (see the module docstring)."""

    def __init__(self):
        self.specs: dict[str, object] = {}

    def find_spec(self, fullname, path=None, target=None):
        if new_path(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = new_path(spec.name)
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=2,  # the importer's line (the import system's own frames are skipped)
        )
        module = importlib.import_module(new)
        self.specs[spec.name] = module.__spec__  # the import system sets the old path's spec on it: restored below
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs.pop(module.__spec__.name)


def install() -> None:
    """Put the finder first on `sys.meta_path` (once per process)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
