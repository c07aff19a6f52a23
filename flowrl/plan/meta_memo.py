"""The output shapes of `meta` ops, remembered: a plan's trace runs each op of a network's repeated blocks with the
same input shapes dozens of times (Qwen-Image's 60 blocks, each denoising step alike), and torch computes a `meta` op's
output by its Python reference implementation every time (type promotion, broadcasting, strides: about a third of a
trace). `MetaMemo` keys an op by its input sizes, strides and dtypes and its other arguments, and builds the
remembered outputs directly.

Only ops whose outputs are new tensors are remembered (no view, in-place or `out=` op: their outputs share an input's
storage, which the plan's memory count must see), and only on plain `meta` tensors."""

from __future__ import annotations

import torch


_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class MetaMemo:
    """`lookup(func, args, kwargs)` -> (key, outputs or None); `store(key, out, extra)` after running a miss."""

    def __init__(self):
        self._fresh: dict = {}  # op -> whether its outputs are new tensors (its schema: no alias, not mutable)
        self._outputs: dict = {}  # key -> (the outputs' template, what the caller keeps beside them)
        self.hits = 0

    def _returns_fresh(self, func) -> bool:
        fresh = self._fresh.get(func)
        if fresh is None:
            schema = func._schema
            fresh = not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
            self._fresh[func] = fresh
        return fresh

    def lookup(self, func, args, kwargs):
        """The op's key (None: not remembered) and, when seen before, its outputs (fresh tensors) and extra."""
        if not self._returns_fresh(func):
            return None, None
        try:
            key = (func, _key(args), _key(kwargs))
        except _Unkeyed:
            return None, None
        found = self._outputs.get(key)
        if found is None:
            return key, None
        self.hits += 1
        template, extra = found
        return key, (_build(template), extra)

    def store(self, key, out, extra=None, aliased: bool = False) -> None:
        """Remember `out` under `key` (nothing when an output is not a plain `meta` tensor made by the op). An op that
        returned an input's storage (`aliased`: a `meta` kernel may hand back an input it had nothing to do to) is
        never remembered: its outputs are not new tensors."""
        if aliased:
            self._fresh[key[0]] = False
            return
        try:
            self._outputs[key] = (_template(out), extra)
        except _Unkeyed:
            pass


class _Unkeyed(Exception):
    """A value that cannot be part of a key (a real tensor, a generator, a symbolic size)."""


class _Meta(tuple):
    """A meta tensor's (sizes, strides, dtype) in a template (a tuple subclass: told apart from a tuple output)."""


def _key(value):
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if value.device.type != "meta":
            raise _Unkeyed
        return (tuple(value.shape), value.stride(), value.dtype, value.storage_offset())
    if kind is tuple or kind is list:
        return (kind, *(_key(v) for v in value))
    if kind is dict:
        return (dict, *((k, _key(v)) for k, v in value.items()))
    if isinstance(value, _SCALARS) and kind in _SCALARS:
        return (kind, value)  # the type too: 1 and 1.0 and True are equal keys otherwise
    raise _Unkeyed


def _template(value):
    kind = type(value)
    if kind is torch.Tensor:
        if value.device.type != "meta" or value.storage_offset() != 0:
            raise _Unkeyed
        return _Meta((tuple(value.shape), value.stride(), value.dtype))
    if kind is tuple or kind is list:
        return kind(_template(v) for v in value)
    if isinstance(value, _SCALARS) and kind in _SCALARS:
        return value
    raise _Unkeyed


def _build(template):
    kind = type(template)
    if kind is _Meta:
        shape, stride, dtype = template
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if kind is tuple or kind is list:
        return kind(_build(v) for v in template)
    return template
