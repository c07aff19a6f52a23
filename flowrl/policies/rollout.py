"""What every modality's rollout gives the shared loop, and typed per-sample records to build one from.

The loop and the core see a rollout as `B` samples with per-element log-probabilities `[B, K]` (denoising
steps for images, tokens for text, actions or denoising steps for control), a mask of the trainable elements,
group ids (the prompt of each sample, for group-relative advantages), row selection, concatenation of parts
sampled with the same settings, device moves and a tensor state for checkpoints. `Rollout` states that
protocol; `Record` implements all of it but the first three for any dataclass whose per-sample fields are
marked with `per_sample()` (rows of the batch), so a modality's rollout, and the typed draws an algorithm
keeps beside it (FIND's initial noise, the flow-matching draws of FPO and AC-Flow), are plain dataclasses.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from flowrl.core.copies import to_device


R = TypeVar("R", bound="Record")


@runtime_checkable
class Rollout(Protocol):
    """The protocol of a rollout (`DiffusionRollout` for images)."""

    log_probs: torch.Tensor
    """`[B, K]` fp32 behaviour log-probabilities of the elements."""

    @property
    def mask(self) -> torch.Tensor:
        """`[B, K]` bool: the trainable elements."""

    @property
    def group_ids(self) -> torch.Tensor:
        """`[B]` group of each sample (its prompt)."""

    def __len__(self) -> int: ...

    def select(self, index): ...

    @classmethod
    def cat(cls, parts): ...

    def to(self, device): ...

    def state_dict(self) -> tuple[dict, dict[str, torch.Tensor]]: ...


def per_sample(**kwargs) -> Any:
    """A dataclass field whose first dimension is the batch: `select` takes its rows, `cat` joins them."""
    return dataclasses.field(metadata={"per_sample": True}, **kwargs)


def _rows(index, n: int) -> torch.Tensor:
    """A slice, bool mask, list or tensor of rows as a long tensor of row indices."""
    if isinstance(index, slice):
        return torch.arange(n)[index]
    index = torch.as_tensor(index)
    if index.dtype == torch.bool:
        return index.nonzero().flatten()
    return index.long().reshape(-1)


def _take(value, rows: torch.Tensor):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[to_device(rows, value.device)]  # host rows: no wait for the device
    if isinstance(value, Record):
        return value.select(rows)
    if isinstance(value, list):
        return [value[i] for i in rows.tolist()]
    raise TypeError(f"cannot select rows of a {type(value).__name__}")


def _join(values: list):
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError("cannot concatenate parts where only some have the field")
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    if isinstance(first, Record):
        return type(first).cat(values)
    if isinstance(first, list):
        return [x for v in values for x in v]
    raise TypeError(f"cannot concatenate {type(first).__name__}")


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape):
            return False
        if a is b or _same_view(a, b):  # one tensor shared by the parts (the negative prompt's cached encoding): no
            return True  # read of device memory, which would wait for the GPU
        return torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage()._cdata == b.untyped_storage()._cdata
    )


def _move(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Record):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


class Record:
    """Mixin for dataclasses of per-sample tensors (fields made with `per_sample()`) and shared settings.

    `select(rows)` indexes every per-sample field; `cat(parts)` concatenates them and requires every other
    field to be equal across the parts; `to(device)` moves every tensor; `state_dict()` / `from_state_dict`
    round-trip the record through JSON and safetensors (tensors, lists of strings, numbers, nested records).
    """

    @classmethod
    def per_sample_fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("per_sample")]

    def __len__(self) -> int:
        for name in self.per_sample_fields():
            value = getattr(self, name)
            if value is not None:
                return len(value)
        return 0

    def select(self: R, index) -> R:
        """The record restricted to the rows `index` (a slice, bool mask or index tensor/list)."""
        rows = _rows(index, len(self))
        return dataclasses.replace(self, **{n: _take(getattr(self, n), rows) for n in self.per_sample_fields()})

    @classmethod
    def cat(cls: type[R], parts: list[R], shared_from_first: tuple[str, ...] = ()) -> R:
        """One record from `parts` in order; every shared field must agree (those in `shared_from_first` are
        taken from the first part unchecked)."""
        parts = list(parts)
        if not parts:
            raise ValueError(f"{cls.__name__}.cat needs at least one part")
        per_sample = cls.per_sample_fields()
        first = parts[0]
        for f in dataclasses.fields(cls):
            if f.name in per_sample or f.name in shared_from_first:
                continue
            for other in parts[1:]:
                if not _equal(getattr(first, f.name), getattr(other, f.name)):
                    raise ValueError(f"cannot concatenate {cls.__name__}s with different {f.name}")
        changes = {}
        for name in per_sample:
            try:
                changes[name] = _join([getattr(p, name) for p in parts])
            except ValueError as err:
                raise ValueError(f"cannot concatenate {cls.__name__}s: {name}: {err}") from None
        return dataclasses.replace(first, **changes)

    def to(self: R, device) -> R:
        """Every tensor on `device`."""
        return dataclasses.replace(
            self, **{f.name: _move(getattr(self, f.name), device) for f in dataclasses.fields(self)}
        )

    def state_dict(self, prefix: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
        """`(json, tensors)`: plain values by field name, tensors by dotted name (CPU, contiguous)."""
        plain, tensors = {}, {}
        for f in dataclasses.fields(self):
            value, key = getattr(self, f.name), prefix + f.name
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().cpu().contiguous()
            elif isinstance(value, Record):
                sub, sub_tensors = value.state_dict(key + ".")
                plain[f.name] = {"record": sub}
                tensors.update(sub_tensors)
            elif isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
                plain[f.name] = {"tensors": sorted(value)}
                tensors.update({f"{key}.{k}": v.detach().cpu().contiguous() for k, v in value.items()})
            else:
                plain[f.name] = list(value) if isinstance(value, tuple) else value
        return plain, tensors

    @classmethod
    def from_state_dict(cls: type[R], plain: dict, tensors: dict[str, torch.Tensor], prefix: str = "") -> R:
        """The record `state_dict()` wrote."""
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if key in tensors:
                values[f.name] = tensors[key]
                continue
            value = plain.get(f.name)
            if isinstance(value, dict) and "record" in value:
                sub = next(
                    t
                    for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                    if isinstance(t, type) and issubclass(t, Record)
                )
                value = sub.from_state_dict(value["record"], tensors, key + ".")
            elif isinstance(value, dict) and "tensors" in value:
                value = {k: tensors[f"{key}.{k}"] for k in value["tensors"]}
            elif isinstance(value, list) and typing.get_origin(hints[f.name]) is tuple:
                value = tuple(value)
            values[f.name] = value
        return cls(**values)


@dataclasses.dataclass
class Collected:
    """One epoch's samples, as every modality's collector returns them.

    `N` samples make the epoch over every process; this process holds `data`, the rows at `rows` of them. Images and
    text carry every process's prompts and rewards (gathered: group statistics are global); control carries its
    episode statistics in `info`.
    """

    data: Any
    """This process's rows (a `Record`: `DiffusionRollout`, `TokenRollout`, `ControlRollout`)."""
    rows: torch.Tensor
    """`[B]` the position of each row of `data` in the epoch's samples of every process."""
    size: int
    """N, the epoch's samples over every process."""
    prompts: list | None = None
    """`[N]` every process's prompts (images, text)."""
    rewards: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Reward name -> `[N]` scores of every process's samples."""
    total: torch.Tensor | None = None
    """`[N]` the weighted sum of the training rewards."""
    group_ids: torch.Tensor | None = None
    """`[N]` the baseline group of each sample (the run driver numbers the algorithm's group keys)."""
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds spent sampling, scoring, ... (`time/*`) and each phase's memory (`memory/*`)."""
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What else the modality reports (control: episode returns and lengths, environment steps)."""
