"""Model families: one module each, holding the family's adapter (a `flowrl.models.adapter.ModelAdapter` subclass
decorated with `@register_family`), its `Options` (the `model.options` a run may set) and its `tiny(seed)` offline
builder. The registry is here, beside its families: importing this package imports every module of it, and each
registers its adapter in `MODEL_FAMILIES` by the decorator alone, so a new family is one new module (plus its test:
`tests/models/test_families.py` runs over the registry)."""

from __future__ import annotations

import importlib
import pkgutil

from flowrl.registry import Registry


MODEL_FAMILIES: Registry = Registry("model family")
"""Family name -> adapter class, filled as this package imports its modules."""


def register_family(cls):
    """Class decorator: register a `ModelAdapter` subclass under its `family` (and its pipeline class)."""
    MODEL_FAMILIES.register(cls.family, cls, description=(cls.__doc__ or "").strip().splitlines()[0])
    return cls


def family_options(family: str, options: dict | None = None):
    """The family's `Options` from `options` (an unknown family, or an option it does not have, fails naming the
    valid ones)."""
    return MODEL_FAMILIES.get(family).make_options(options)


def adapter_for(pipeline, options=None):
    """The adapter for a diffusers pipeline instance (every registered family: `MODEL_FAMILIES`), with the family's
    `options` (a dict of its `Options` fields, or an `Options`)."""
    name = type(pipeline).__name__
    for family in MODEL_FAMILIES:
        cls = MODEL_FAMILIES.get(family)
        if cls.pipeline_class == name:
            return cls(pipeline, options=options)
    supported = ", ".join(MODEL_FAMILIES.get(f).pipeline_class for f in MODEL_FAMILIES)
    raise ValueError(f"no flowrl adapter for {name}; supported pipelines: {supported}")


for _module in pkgutil.iter_modules(__path__):  # after the definitions above: each family imports `register_family`
    importlib.import_module(f"{__name__}.{_module.name}")


__all__ = ["MODEL_FAMILIES", "adapter_for", "family_options", "register_family"]
