"""Tracing a run's memory without a GPU: live tensor bytes under FakeTensorMode, and CUDA's autocast emulated.

`LiveMemory` is a dispatch mode that counts the bytes of every tensor storage alive (each storage once, however many
views share it) and keeps the peak of each named phase; under `FakeTensorMode` the tensors hold no data, so a 20B
network's forward and backward at its real shapes trace on a CPU in seconds. What it counts is what CUDA's caching
allocator reports as allocated (`torch.cuda.max_memory_allocated`), up to its 512-byte rounding, cuBLAS workspaces and
the attention kernels' scratch space.

`CudaAutocast` replays what `torch.autocast("cuda", dtype)` does to each op's inputs (CPU autocast differs: it keeps
layer norms and softmaxes in bf16, so activations there are smaller than on a GPU): matrix products, convolutions and
attention run in the low precision, reductions and norms in fp32 (PyTorch's `autocast_mode.cpp` op lists). It works
at the Python API (a `TorchFunctionMode`), above autograd, so the casts are recorded and the tensors autograd saves
are the cast ones, as on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from flowrl.plan.meta_memo import MetaMemo


GiB = 2**30


def leaves(values) -> list:
    """`tree_flatten(values)[0]`, with plain tuples, lists and dicts walked directly: an op's arguments are nearly
    always these, and torch's pytree costs a third of a 20B network's trace (other containers go through it)."""
    out: list = []
    stack = [values]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is tuple or kind is list:
            stack.extend(reversed(value))
        elif kind is dict:
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, (tuple, list, dict)):  # named tuples, structseqs, ordered dicts: pytree's rules
            out.extend(tree_flatten(value)[0])
        else:
            out.append(value)
    return out


def map_leaves(fn, values):
    """`tree_map(fn, values)`, with plain tuples, lists and dicts rebuilt directly (see `leaves`)."""
    kind = type(values)
    if kind is tuple:
        return tuple(map_leaves(fn, v) for v in values)
    if kind is list:
        return [map_leaves(fn, v) for v in values]
    if kind is dict:
        return {k: map_leaves(fn, v) for k, v in values.items()}
    if isinstance(values, (tuple, list, dict)):
        return tree_map(fn, values)
    return fn(values)


@dataclass
class Phase:
    """One phase's memory: the live bytes when it started and ended, and its peak."""

    name: str
    start: int = 0
    end: int = 0
    peak: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    """Bytes a phase holds besides its traced tensors (e.g. what a partly traced phase adds by arithmetic)."""

    @property
    def peak_total(self) -> int:
        return self.peak + sum(self.extra.values())


class LiveMemory(TorchDispatchMode):
    """Bytes of the live tensor storages (see the module docstring): `current`, and each `phase`'s peak.

    Tensors created before the mode was entered (a network's weights) count once they are `register`ed."""

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id of the storage's weakref -> bytes
        self._refs: dict[int, weakref.ref] = {}  # storage key -> its weakref
        self.phases: dict[str, Phase] = {}
        self.flops = 0
        """FLOPs of the matrix products, convolutions and attention traced (`torch.utils.flop_counter`'s formulas;
        counted here, in the same pass: its `FlopCounterMode` keeps a graph's module hooks alive)."""
        self.memo = MetaMemo()

    def register(self, tensors) -> None:
        """Count these (already existing) tensors, e.g. a module's parameters and buffers."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t)

    def _key(self, storage) -> int:
        return storage._cdata

    def _track(self, t: torch.Tensor) -> None:
        if not _has_storage(t):  # a tensor without storage (sparse, nested): not traced
            return
        storage = t.untyped_storage()
        key = self._key(storage)
        if key in self._refs and self._refs[key]() is not None:
            return
        size = storage.nbytes()
        ref = weakref.ref(storage, self._freed(key))
        self._refs[key] = ref
        self._sizes[key] = size
        self.current += size
        self._raise_peak()

    def _freed(self, key: int):
        def callback(_):
            size = self._sizes.pop(key, 0)
            self._refs.pop(key, None)
            self.current -= size

        return callback

    def _raise_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
        for phase in self._open:
            if self.current > phase.peak:
                phase.peak = self.current

    _open: tuple[Phase, ...] = ()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure a phase: its start and end bytes and its own peak."""
        phase = self.phases.setdefault(name, Phase(name))
        phase.start = phase.peak = self.current
        self._open = (*self._open, phase)
        try:
            yield phase
        finally:
            self._open = tuple(p for p in self._open if p is not phase)
            phase.end = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():  # a remembered op's outputs: built without the function modes
            key, found = self.memo.lookup(func, args, kwargs)
        if found is not None:
            out, flops = found
        else:
            out = func(*args, **kwargs)
            formula = flop_registry.get(func._overloadpacket)
            # FLOPs by torch's formulas (matmuls, convolutions, attention), from the shapes
            flops = 0 if formula is None else formula(*args, **kwargs, out_val=out)
        self.flops += flops
        with torch._C.DisableTorchFunction():  # storage lookups are bookkeeping: not through the function modes
            inputs = {self._key(t.untyped_storage()) for t in leaves((args, kwargs)) if _has_storage(t)}
            aliased = False
            for t in leaves(out):
                if not _has_storage(t):
                    continue
                if self._key(t.untyped_storage()) in inputs:  # views, in-place: no allocation
                    aliased = True
                else:
                    self._track(t)
            if key is not None and found is None:
                self.memo.store(key, out, flops, aliased)
        return out


def _has_storage(t) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    try:
        t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # a tensor without storage (sparse, nested)
        return False
    return True


# torch.autocast("cuda") op lists (aten/src/ATen/autocast_mode.cpp): ops run in the low precision, ops run in fp32
# (fp32 and fp32_set_opt_dtype), by the name of the Python function or Tensor method that reaches them
LOW_PRECISION_OPS = frozenset(
    {
        "linear",
        "matmul",
        "__matmul__",
        "__rmatmul__",
        "mm",
        "bmm",
        "baddbmm",
        "addmm",
        "addbmm",
        "addmv",
        "addr",
        "mv",
        "einsum",
        "chain_matmul",
        "multi_dot",
        "prelu",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "conv_tbc",
        "scaled_dot_product_attention",
        "multi_head_attention_forward",  # nn.MultiheadAttention (SigLIP's pooling head): a Python function whose
        # own ops this mode does not see (a mode is off inside its handler); its projections and products are
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
    }
)
FP32_OPS = frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "__pow__",
        "__rpow__",
        "softplus",
        "layer_norm",
        "group_norm",
        "norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "prod",
        "softmax",
        "log_softmax",
        "cumprod",
        "cumsum",
        "vector_norm",
        "matrix_norm",
    }
)
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)
_METADATA = frozenset(
    [
        *(getattr(torch.Tensor, name).__get__ for name in ("dtype", "shape", "device", "ndim", "requires_grad")),
        *(getattr(torch.Tensor, name).__get__ for name in ("is_leaf", "grad_fn", "layout", "is_meta", "is_cuda")),
        *(torch.Tensor.numel, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.element_size, torch.Tensor.stride),
        *(torch.Tensor.is_floating_point, torch.Tensor.is_complex),
    ]
)
"""A tensor's metadata reads: no mode here changes them, and they are two thirds of the calls a trace makes (each
mode's own checks read dtypes and shapes, which the modes below it would see again)."""


class _TraceMode(TorchFunctionMode):
    """A function mode that stays on for the backward: `Tensor.backward` is run by autograd with this mode on the
    stack (inside a mode's own handler the mode is off, so a checkpointed block's recomputation would otherwise run
    without it and save other tensors than its forward did)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:  # read past every mode (see `_METADATA`)
            with torch._C.DisableTorchFunction():
                return func(*args, **kwargs)
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return self._backward(func, args, kwargs)
        try:
            return self.handle(func, args, kwargs)
        except NotImplementedError as err:  # a library's data-dependent shape (a mask's nonzero) on meta tensors
            if "meta_nonzero_assume_all_nonzero" not in str(err) or _called_from_flowrl():
                raise
            from torch.fx.experimental import _config

            with _config.patch(meta_nonzero_assume_all_nonzero=True):  # every element kept: the largest shape
                return self.handle(func, args, kwargs)

    def _backward(self, func, args, kwargs) -> None:
        """Autograd's engine on `Tensor.backward` / `torch.autograd.backward`'s arguments, called with this mode back
        on the stack (calling the public function would only reach the next mode's handler)."""
        from torch.autograd.graph import _engine_run_backward

        first = "gradient" if func is torch.Tensor.backward else "grad_tensors"
        names = (first, "retain_graph", "create_graph", "inputs")
        bound = {**dict(zip(names, args[1:])), **kwargs}
        tensors = (args[0],) if isinstance(args[0], torch.Tensor) else tuple(args[0])
        grads = bound.get(first)
        grads = (grads,) if grads is None or isinstance(grads, torch.Tensor) else tuple(grads)
        grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads * len(tensors)))
        create = bound.get("create_graph", False)
        retain = create if bound.get("retain_graph") is None else bound["retain_graph"]
        inputs = bound.get("inputs")
        inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        with self:
            _engine_run_backward(tensors, grads, retain, create, inputs, allow_unreachable=True, accumulate_grad=True)

    def handle(self, func, args, kwargs):
        return func(*args, **kwargs)


class CudaAutocast(_TraceMode):
    """`torch.autocast("cuda", dtype)`'s casts, replayed on any device (see the module docstring)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dtype = dtype

    def handle(self, func, args, kwargs):
        name = getattr(func, "__name__", "")
        target = None
        if name in LOW_PRECISION_OPS:
            target = self.dtype
        elif name in FP32_OPS and kwargs.get("dtype") is None:
            target = torch.float32
        if target is not None:

            def cast(t):
                if isinstance(t, torch.Tensor) and t.dtype in _CASTABLE and t.dtype != target:
                    return t.to(target)
                return t

            args, kwargs = map_leaves(cast, (args, kwargs))
        return func(*args, **kwargs)


class GpuAttention(_TraceMode):
    """`scaled_dot_product_attention` as a GPU runs it with the backends `model.attention_backend: auto` chooses:
    flash attention (no mask) or memory-efficient attention (a mask as an additive bias), which keep `O(N)` per head
    for the backward (the output and its log-sum-exp), where the math path a CPU or `meta` tensor would take keeps
    the `N x N` attention matrices. Traced memory is then the GPU's."""

    def handle(self, func, args, kwargs):
        if func is torch.Tensor.__bool__ and args[0].device.type == "meta" and not _called_from_flowrl():
            return False  # a library's branch on a device value (HunyuanVideo 1.5: `all(image_embeds == 0)`)
        if getattr(func, "__name__", "") != "scaled_dot_product_attention":
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = {**dict(zip(names, args)), **kwargs}
        q, k, v = bound["query"], bound["key"], bound["value"]
        if q.device.type != "meta":  # the kernels' meta functions stand in for the GPU's; real tensors run as they are
            return func(*args, **kwargs)
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention: each key/value head serves several query heads
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        mask, dropout = bound.get("attn_mask"), bound.get("dropout_p", 0.0)
        causal, scale = bound.get("is_causal", False), bound.get("scale")
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]
        if mask.dtype == torch.bool:  # the kernels take a mask as an additive bias
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        bias = mask.to(q.dtype).expand(*q.shape[:-1], k.shape[-2])
        grad = q.requires_grad or k.requires_grad or v.requires_grad
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, grad, dropout, causal, scale=scale
        )[0]


def _called_from_flowrl() -> bool:
    """Whether the code asking for a tensor's truth value is flowrl's own (its host reads must raise in a trace: they
    would wait for the GPU), not a library's (diffusers' and transformers' branches on device values are theirs:
    a trace takes their False side, whose shapes and memory are the same in the cases met so far)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename.startswith(_PLAN)):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_PACKAGE)


_PLAN = os.path.dirname(os.path.abspath(__file__)) + os.sep  # flowrl.plan's own frames (the trace modes)
_PACKAGE = os.path.dirname(_PLAN[:-1]) + os.sep  # flowrl's: by path, whatever the checkout's folder is called


def count_flops(fn) -> int:
    """FLOPs `fn` executes (torch's `FlopCounterMode`: matrix products, convolutions, attention), counted on any
    tensors, fake ones included, so a GPU run's FLOPs are counted without its memory."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
