"""Rollouts and weights as bytes between processes: safetensors plus a JSON header, never pickles.

The asynchronous mode (`flowrl.run.async_rollouts`) moves each epoch's `Collected` batch from a rollout worker
to the learner, and the learner's weights back. Both travel as one safetensors blob: the tensors by name, and the
rest (numbers, strings, prompts, the rollout's plain fields) as JSON in the blob's metadata. Decoding builds only
flowrl's own `Record` dataclasses, `Collected` and `Prompt`; a blob naming anything else is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from flowrl.policies.rollout import Collected, Record


class WireError(ValueError):
    """A blob that is not one flowrl wrote (or names a class outside flowrl's records)."""


def _record_class(name: str) -> type[Record]:
    module, _, qualname = name.partition(":")
    if not module.startswith("flowrl."):
        raise WireError(f"a rollout blob may only name flowrl's records, got {name!r}")
    cls = getattr(importlib.import_module(module), qualname, None)
    if not (isinstance(cls, type) and issubclass(cls, Record) and dataclasses.is_dataclass(cls)):
        raise WireError(f"{name!r} is not a flowrl Record")
    return cls


class _Encoder:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def tensor(self, value: torch.Tensor) -> dict:
        key = f"t{len(self.tensors)}"
        self.tensors[key] = value.detach().cpu().contiguous()
        return {"$tensor": key}

    def __call__(self, value: Any) -> Any:
        from flowrl.prompts import Prompt

        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, Record):
            prefix = f"r{len(self.tensors)}."
            plain, tensors = value.state_dict(prefix)
            self.tensors.update(tensors)
            cls = type(value)
            return {"$record": f"{cls.__module__}:{cls.__qualname__}", "prefix": prefix, "plain": self(plain)}
        if isinstance(value, Prompt):
            if any(not isinstance(image, str) for image in value.images):
                raise WireError("an editing prompt's source images must be paths to travel to the learner")
            return {"$prompt": {"text": value.text, "metadata": self(value.metadata), "images": list(value.images)}}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise WireError(f"dict keys must be strings, got {sorted(map(repr, value))[:3]}")
            return {"$dict": {k: self(v) for k, v in value.items()}}
        if isinstance(value, tuple):
            return {"$tuple": [self(v) for v in value]}
        if isinstance(value, list):
            return [self(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise WireError(f"cannot send a {type(value).__name__} between processes")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    from flowrl.prompts import Prompt

    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return tensors[value["$tensor"]]
    if "$record" in value:
        cls = _record_class(value["$record"])
        return cls.from_state_dict(_decode(value["plain"], tensors), tensors, value["prefix"])
    if "$prompt" in value:
        p = value["$prompt"]
        return Prompt(p["text"], _decode(p["metadata"], tensors), tuple(p["images"]))
    if "$dict" in value:
        return {k: _decode(v, tensors) for k, v in value["$dict"].items()}
    if "$tuple" in value:
        return tuple(_decode(v, tensors) for v in value["$tuple"])
    raise WireError(f"unknown entry in a rollout blob: {sorted(value)[:3]}")


def encode(value: Any, **header: Any) -> bytes:
    """`value` (a `Collected`, a dict of tensors, ...) and JSON-able `header` entries as one safetensors blob."""
    enc = _Encoder()
    if isinstance(value, Collected):
        body = {"$collected": {f.name: enc(getattr(value, f.name)) for f in dataclasses.fields(Collected)}}
    else:
        body = enc(value)
    meta = {"flowrl_wire": "1", "body": json.dumps(body), "header": json.dumps(enc(header))}
    return st_save(enc.tensors, metadata=meta)


def decode(blob: bytes) -> tuple[Any, dict]:
    """`(value, header)` of a blob `encode` wrote."""
    meta = _metadata(blob)
    try:
        tensors = st_load(blob)
    except Exception as err:  # noqa: BLE001  (safetensors raises several types for a damaged blob)
        raise WireError(f"not a flowrl rollout blob: {err}") from None
    if meta.get("flowrl_wire") != "1":
        raise WireError("not a flowrl rollout blob (no flowrl_wire header)")
    body = json.loads(meta["body"])
    header = _decode(json.loads(meta["header"]), tensors)
    if isinstance(body, dict) and "$collected" in body:
        fields = {k: _decode(v, tensors) for k, v in body["$collected"].items()}
        return Collected(**fields), header
    return _decode(body, tensors), header


def _metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob (its 8-byte length, then the JSON header)."""
    if len(blob) < 8:
        raise WireError("not a flowrl rollout blob: too short")
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise WireError("not a flowrl rollout blob: truncated header")
    try:
        return json.loads(blob[8 : 8 + size]).get("__metadata__", {}) or {}
    except (ValueError, AttributeError) as err:
        raise WireError(f"not a flowrl rollout blob: {err}") from None
