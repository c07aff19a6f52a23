"""The values of a trace's small host-made tensors, for the library code that reads them back.

A trace runs on `meta` tensors, which hold no data. Libraries read some of their tensors back on the host: token
counts (`torch.split(hidden[mask], mask.sum(1).tolist())`, diffusers' Qwen-Image 2.1 prompt encoding), image grids
(transformers' Qwen2.5-VL vision tower, `grid_thw.tolist()`), and index by boolean masks, whose selected shape depends
on the data. Those tensors are small and made from host data: token ids and masks from a tokenizer, grids from an
image processor, positions from `arange`. `HostValues` keeps a CPU copy beside each such `meta` tensor (at most
`LIMIT` elements), computes every op whose `meta` inputs all have one on the copies as well, answers a library's
host read (`tolist`, `item`, truth values, `.cpu()`) from the copy, and indexes by a boolean mask with a copy at the
positions the copy selects, so a trace takes the run's own shapes. flowrl's own host reads still raise: on a GPU
each would wait for the device.
"""

from __future__ import annotations

import torch

from flowrl.plan.trace import _called_from_flowrl, _TraceMode, leaves, map_leaves


LIMIT = 1 << 16
"""Elements of the largest tensor kept on the host (token ids, masks, grids, lengths; never activations)."""

HOST_READS = frozenset(
    {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "cpu", "numpy", "to"}
)
_RANDOM = frozenset(
    {
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "normal",
        "bernoulli",
        "multinomial",
        "normal_",
        "uniform_",
        "random_",
        "exponential_",
        "bernoulli_",
    }
)
_IN_PLACE = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
    }
)
_ATTRIBUTE = "_flowrl_host"


def host_value(t) -> torch.Tensor | None:
    """The CPU copy kept beside the `meta` tensor `t`, or None."""
    if not isinstance(t, torch.Tensor):
        return None
    with torch._C.DisableTorchFunction():  # bookkeeping reads: past the function modes (a third of a trace's calls)
        return getattr(t, _ATTRIBUTE, None) if t.device.type == "meta" else None


def _keep(meta: torch.Tensor, host: torch.Tensor) -> None:
    setattr(meta, _ATTRIBUTE, host)


def _to_meta(value):
    if not isinstance(value, torch.Tensor):
        return value
    meta = value.to("meta")
    _keep(meta, value)
    return meta


def _on_host(value):
    """`value` with each `meta` tensor replaced by its copy and each `meta` device by the CPU."""
    if isinstance(value, torch.Tensor):
        return host_value(value) if value.device.type == "meta" else value
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    if isinstance(value, str) and value.split(":")[0] == "meta":
        return "cpu"
    return value


def _metas(values) -> list[torch.Tensor]:
    with torch._C.DisableTorchFunction():  # (as in `host_value`)
        return [t for t in leaves(values) if isinstance(t, torch.Tensor) and t.device.type == "meta"]


def _small(tensors, meta: bool = False) -> bool:
    """Whether every tensor has at most LIMIT elements (`meta`: and is on `meta`)."""
    with torch._C.DisableTorchFunction():  # (as in `host_value`)
        return all(t.numel() <= LIMIT and (not meta or t.device.type == "meta") for t in tensors)


class HostValues(_TraceMode):
    """Keeps the host values of small host-made `meta` tensors (see the module docstring)."""

    def handle(self, func, args, kwargs):
        name = getattr(func, "__name__", "")
        metas = _metas((args, kwargs))
        known = bool(metas) and all(host_value(t) is not None for t in metas)
        if name in HOST_READS and known and not _called_from_flowrl():
            try:  # a read back (`to` another meta device, or a dtype, stays a tensor op: tried first)
                return func(*args, **kwargs) if name == "to" else self._read(func, args, kwargs)
            except NotImplementedError:  # "Cannot copy out of meta tensor": `.to("cpu")`
                return self._read(func, args, kwargs)
        if name in ("__getitem__", "__setitem__") and isinstance(args[0], torch.Tensor):
            args = (args[0], _mask_positions(args[1]), *args[2:])
            metas = _metas((args, kwargs))
            known = bool(metas) and all(host_value(t) is not None for t in metas)
        if name == "repeat_interleave" and "output_size" not in kwargs:  # by counts the host knows: their total
            repeats = host_value(args[1] if len(args) > 1 else kwargs.get("repeats"))
            if repeats is not None and repeats.dim() <= 1 and not repeats.is_floating_point():
                kwargs = {**kwargs, "output_size": int(repeats.sum())}
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):  # a shape `meta` cannot know (repeat_interleave by counts)
            if not known or not _small(metas) or name in HOST_READS:  # flowrl's own read: raised
                raise
            return map_leaves(_to_meta, self._read(func, args, kwargs))
        if name in _IN_PLACE or (name.endswith("_") and not name.startswith("_")):
            return self._in_place(func, args, kwargs, out, known and _small(metas))
        outs = [t for t in leaves(out) if isinstance(t, torch.Tensor)]
        if not outs or not _small(outs, meta=True):
            return out
        if not metas:  # made on meta from host data (`x.to(device)`, `arange(n, device=device)`)
            if name in _RANDOM or "generator" in kwargs:
                return out
        elif not known or not _small(metas):
            return out
        try:
            host = func(*map_leaves(_on_host, args), **map_leaves(_on_host, kwargs))
        except Exception:  # an op the CPU does not run on these dtypes: the trace goes on without the copies
            return out
        hosts = [t for t in leaves(host) if isinstance(t, torch.Tensor)]
        if len(hosts) != len(outs) or any(h.device.type != "cpu" for h in hosts):
            return out
        if all(h.shape == t.shape for h, t in zip(hosts, outs)):
            inputs = {id(t) for t in leaves((args, kwargs))}
            for h, t in zip(hosts, outs):
                _keep(t, h.clone() if id(h) in inputs else h)  # `x.to(meta)` gives x itself back on the host
            return out
        return map_leaves(_to_meta, host)  # a shape that depends on the values: the host's

    def _in_place(self, func, args, kwargs, out, known: bool):
        """An op that writes into its first argument: into its host copy too, which is dropped when the values written
        are not all known."""
        target = args[0]
        if isinstance(target, torch.Tensor) and host_value(target) is not None:
            try:
                if not known:
                    raise ValueError
                self._read(func, args, kwargs)
            except Exception:  # the copy would go stale
                delattr(target, _ATTRIBUTE)
        return out

    @staticmethod
    def _read(func, args, kwargs):
        return func(*map_leaves(_on_host, args), **map_leaves(_on_host, kwargs))


def _mask_positions(index):
    """A boolean `meta` mask with a host copy, as the index tensors of the positions it selects."""
    if isinstance(index, tuple):
        return tuple(p for i in index for p in _expand(i))
    expanded = _expand(index)
    return expanded if len(expanded) != 1 or expanded[0] is not index else index


def _expand(index) -> tuple:
    host = host_value(index)
    if host is None or host.dtype != torch.bool:
        return (index,)
    return tuple(_to_meta(p) for p in host.nonzero(as_tuple=True))


class HostCopies(_TraceMode):
    """Copies of `meta` tensors to the host as zeros of their shape and dtype: an algorithm's data kept in CPU memory
    (DPOK's replay buffer, AWM's stored draws) in the epoch's preparation, outside the step loops, whose values do
    not change what the GPU holds."""

    def handle(self, func, args, kwargs):
        name = getattr(func, "__name__", "")
        source = args[0] if args else None
        if name in ("cpu", "to") and isinstance(source, torch.Tensor) and source.device.type == "meta":
            try:
                return func(*args, **kwargs)
            except NotImplementedError:  # "Cannot copy out of meta tensor": the host copy
                dtype = next((a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.dtype)), source.dtype)
                return torch.zeros(source.shape, dtype=dtype)
        return func(*args, **kwargs)
