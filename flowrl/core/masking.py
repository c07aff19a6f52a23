"""Masked elementwise primitives that stay fast on long `[B, K]` tensors (tokens).

On CPU, a comparison that writes a bool tensor, a bool-to-float cast and `torch.where` cost 3-15x an
elementwise multiply (torch 2.13, AVX2, one thread, B=64, K=1024: `x * m` 16 us, `torch.where(m, x, 0)`
157 us, `x > c` 46 us, `torch.gt(x, c, out=float)` 15 us; `benchmarks/llm_objectives.py` times the losses).
The core's hot path therefore uses float 0/1 indicators and products; the results are bit-identical to the
`where` formulation wherever the inputs are finite, and non-finite padding falls back to `where`.
"""

from __future__ import annotations

import math

import torch


def float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`mask` (bool, integer or float, 1 = valid) as a 0/1 tensor of `dtype`."""
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # uint8 -> float converts 3x faster than bool -> float
    return mask.to(dtype)


def select_valid(x: torch.Tensor, mask: torch.Tensor, fmask: torch.Tensor) -> torch.Tensor:
    """`x` where `mask` is set, else 0, with the gradient of `torch.where(mask, x, 0)`.

    `fmask` is `float_mask(mask, x.dtype)`. Padding may hold NaN or inf (it never reaches the result): the
    product `x * fmask` is used when it is finite everywhere, `torch.where` otherwise (and on accelerators,
    where `where` is as fast as a product and a host sync is not).
    """
    return select_valid_checked(x, mask, fmask)[0]


def select_valid_checked(x: torch.Tensor, mask: torch.Tensor, fmask: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """`(select_valid(x, mask, fmask), finite)`: `finite` is True only when `x` was seen finite everywhere (the
    CPU product path), so anything `x` was computed from elementwise may be masked by a product alone."""
    if x.device.type == "cpu":
        product = x * fmask  # [B, K]; exact: x * 1 = x, x * 0 = 0 for finite x
        # a finite sum means no NaN/inf anywhere (an overflowing sum only takes the where path)
        if math.isfinite(product.sum().item()):
            return product, True
    return torch.where(mask.bool(), x, 0.0), False


def greater(a: torch.Tensor, b, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Float 0/1 indicator of `a > b` (broadcast), without autograd."""
    return _compare(torch.gt, a, b, dtype)


def less(a: torch.Tensor, b, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Float 0/1 indicator of `a < b` (broadcast), without autograd."""
    return _compare(torch.lt, a, b, dtype)


def greater_equal(a: torch.Tensor, b, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Float 0/1 indicator of `a >= b` (broadcast), without autograd."""
    return _compare(torch.ge, a, b, dtype)


def _compare(op, a: torch.Tensor, b, dtype: torch.dtype | None) -> torch.Tensor:
    a = a.detach()
    b = b.detach() if isinstance(b, torch.Tensor) else b
    shape = torch.broadcast_shapes(a.shape, b.shape) if isinstance(b, torch.Tensor) else a.shape
    dtype = dtype or (a.dtype if a.is_floating_point() else torch.float32)
    return op(a, b, out=torch.empty(shape, dtype=dtype, device=a.device))  # writing floats skips the bool cast
