"""Model families: one module each, holding the family's adapter (`flowrl.policies.adapters.ModelAdapter`), its
`Options` (the `model.options` a run may set) and its `tiny(seed)` offline builder. Every module of this package is
imported here and registers its adapter in `MODEL_FAMILIES`, so a new family is one new module (plus its test:
`tests/models/test_families.py` runs over the registry)."""

from __future__ import annotations

import importlib
import pkgutil

from flowrl.policies.adapters import MODEL_FAMILIES


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def family_options(family: str, options: dict | None = None):
    """The family's `Options` from `options` (an unknown family, or an option it does not have, fails naming the
    valid ones)."""
    return MODEL_FAMILIES.get(family).make_options(options)


__all__ = ["MODEL_FAMILIES", "family_options"]
