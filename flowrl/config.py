"""Typed run configs: the machinery that fills dataclasses from YAML plus `--set key=value` overrides.

Sections are dataclasses with a docstring per field: the shared ones (`run`, `optim`, `batch`, `eval`, rewards,
objective, advantage, KL) in `flowrl.sections`, each modality's in its package (`flowrl.image.config`,
`flowrl.control.config`, `flowrl.llm.config`), each trainer's config class beside its algorithm; the `trainer` key
picks the class (`flowrl.trainers.load_config`). YAML files only override defaults. An unknown key fails with a
message naming it, the close matches and the valid keys (a key of an earlier version names its new place); a value
of the wrong type or outside a `Literal` fails naming the key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from flowrl.registry import unknown_name_error


class ConfigError(ValueError):
    """An invalid config key or value; the message names the key."""


def run_checks(checks: list[tuple[bool, str]]) -> None:
    """Raise a `ValueError` with the message of the first failed `(condition, message)` pair."""
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


# ----------------------------------------------------------------------------------------------
# dict <-> dataclass with validation
# ----------------------------------------------------------------------------------------------


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp, key: str, renamed: dict[str, str] | None = None) -> Any:
    """`value` checked against (and lightly converted to) the annotation `tp`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(value, option, key, renamed)
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"invalid value {value!r} for {key}: {'; '.join(errors)}")
    if origin is Literal:
        if isinstance(value, bool) and not any(isinstance(a, bool) for a in args):
            # YAML 1.1 reads no/off/false (yes/on/true) as booleans: map them back to a spelled-out choice
            spellings = ("no", "off", "false") if value is False else ("yes", "on", "true")
            value = next((a for a in args if a in spellings), value)
        if value not in args:
            raise ConfigError(f"invalid value {value!r} for {key}; choose from {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        selector = getattr(tp, "selector", None)
        if selector and isinstance(value, str):
            raise ConfigError(
                f"{key} is a section: write {key}.{selector}: {value} (or {key}: {{{selector}: {value}}})"
            )
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=key, renamed=renamed)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key} must have {len(args)} entries, got {value!r}")
            return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        converted = [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(converted) if origin is tuple else converted
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {_type_name(tp)}")


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _merge(base: dict, update: dict) -> dict:
    """`update` over `base`, recursively for nested mappings."""
    merged = dict(base)
    for key, value in update.items():
        nested = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if nested else value
    return merged


def from_dict(
    cls, data: dict, prefix: str = "", renamed: dict[str, str] | None = None, absent: dict[str, str] | None = None
):
    """Build the dataclass `cls` from `data`, validating every key and value.

    `renamed` maps keys of earlier versions (full dotted paths) to where they went: using one fails with a
    message that names the new key. `absent` maps keys other trainers have, which this one does not, to why (a
    section an algorithm has no use for is not there: setting it fails with the reason).
    """
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields or not fields[key].init:
            if renamed and full in renamed:
                raise ConfigError(f"config key {full!r} was renamed: use {renamed[full]}")
            if absent and full in absent:
                raise ConfigError(f"config key {full!r} does not apply here: {absent[full]}")
            valid = [n for n, f in fields.items() if f.init]
            where = f"in section {prefix!r}" if prefix else "at the top level"
            message = str(unknown_name_error("config key", key, valid, where=where))
            raise ConfigError(message.replace(f"config key {key!r}", f"config key {full!r}", 1))
        default = _default(fields[key])
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            # a partial section overrides the *field's* defaults (a trainer may change them, e.g. GRPO-Guard's
            # step weighting), not the section class's; but a section that picks another algorithm piece
            # (objective.name, advantage.estimator) starts from the class defaults, so the trainer's settings
            # of its own piece (Flow-GRPO's clip range for ppo) do not leak into the chosen one
            selector = getattr(type(default), "selector", None)
            base = default
            if selector and selector in value and value[selector] != getattr(default, selector):
                base = type(default)(**{selector: getattr(default, selector)})
            value = _merge(to_dict(base), value)
        kwargs[key] = _convert(value, hints[key], full, renamed)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{prefix or cls.__name__}: {err}") from err


def to_dict(config) -> dict:
    """A YAML-friendly nested dict of a config (tuples become lists)."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(config)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides (values parsed as YAML: `1e-4`, `true`, `[1, 2]`, `null`)."""
    data = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            problem = " ".join(str(getattr(err, "problem", None) or err).split())
            raise ConfigError(
                f"override {item!r}: the value {raw!r} is not valid YAML ({problem}); quote it "
                "or write a list as [1, 2]"
            ) from None
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {err.start}: {err.object[err.start : err.start + 1]!r}); "
            "save it as UTF-8"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def save_config(config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
