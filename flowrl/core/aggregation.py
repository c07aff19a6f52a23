"""Masked reductions of a per-element loss `[B, K]` to a scalar.

How the per-element loss is reduced is what separates GRPO, DAPO and Dr.GRPO; it is a separate axis
from the objective, as in verl's `agg_loss`. K is tokens for text and denoising steps for images.
"""

from __future__ import annotations

import torch

from flowrl.registry import unknown_name_error


AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "sum")


def aggregate(loss: torch.Tensor, mask: torch.Tensor, agg: str = "token_mean", *, norm_len: float | None = None):
    """Reduce a masked per-element loss to a scalar.

    With `m` the mask, `n_i = sum_t m[i, t]` and `B'` the number of rows with `n_i > 0`:

    - `token_mean`: `sum m*l / sum m` (DAPO, arXiv:2503.14476 sec. 3.3; every valid element counts once),
    - `seq_mean_token_mean`: `(1/B') sum_i (sum_t m*l) / n_i` (GRPO, arXiv:2402.03300 eq. 3),
    - `seq_mean_token_sum`: `(1/B') sum_i sum_t m*l`,
    - `seq_mean_token_sum_norm`: `sum m*l / (B' * L)` with a constant `L` = `norm_len`
      (Dr.GRPO, arXiv:2503.20783 sec. 3; default `L` = K, the padded length),
    - `sum`: `sum m*l` (no normaliser; a caller that splits a batch supplies its own per-element weights).

    Every mode is linear in `l` with coefficients that depend on the mask only:
    `aggregate(l) = sum(aggregation_weights(mask) * l)`, which is what lets a trainer split the K axis.

    Args:
        loss (`torch.Tensor`): per-element loss `[B, K]`.
        mask (`torch.Tensor`): `[B, K]`, 1 where the element counts (bool or float).
        agg (`str`, defaults to `"token_mean"`): one of `AGGREGATIONS`.
        norm_len (`float`, *optional*): the constant `L` of `seq_mean_token_sum_norm`.

    An all-masked batch gives a loss of 0 (not NaN) that still carries a (zero) gradient.
    """
    mask = mask.to(loss.dtype)
    if agg == "token_mean":
        # clamp: an all-masked batch divides 0 by 1 instead of 0 by 0
        return torch.dot(loss.reshape(-1), mask.reshape(-1)) / mask.sum().clamp_min(1.0)
    if agg == "sum":
        return torch.dot(loss.reshape(-1), mask.reshape(-1))
    masked = loss * mask  # [B, K]
    n_i = mask.sum(-1)  # [B]
    num_seqs = (n_i > 0).sum().clamp_min(1)  # B'; clamp for an all-masked batch
    row_sum = masked.sum(-1)  # [B]
    if agg == "seq_mean_token_mean":
        return (row_sum / n_i.clamp_min(1.0)).sum() / num_seqs
    if agg == "seq_mean_token_sum":
        return row_sum.sum() / num_seqs
    if agg == "seq_mean_token_sum_norm":
        length = float(loss.shape[-1] if norm_len is None else norm_len)
        if length <= 0:
            raise ValueError(f"norm_len must be positive, got {norm_len}")
        return row_sum.sum() / (num_seqs * length)
    raise unknown_name_error("aggregation", agg, list(AGGREGATIONS))


def aggregation_weights(mask: torch.Tensor, agg: str = "token_mean", *, norm_len: float | None = None):
    """`[B, K]` coefficients `a` with `aggregate(l, mask, agg) == sum(a * l)` for every `l` (0 off the mask).

    The aggregation of a per-element loss is a weighted sum whose weights depend on the mask alone, so a loss
    computed over part of the K axis at a time (one denoising step's graph in memory) can be weighted exactly.
    """
    m = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    # products by reciprocals: one pass over [B, K] at multiply speed, bit-identical to the divisions for 0/1 masks
    if agg == "token_mean":
        return m * m.sum().clamp_min(1.0).reciprocal()
    if agg == "sum":
        return m
    n_i = m.sum(-1, keepdim=True)  # [B, 1]
    num_seqs = (n_i > 0).sum().clamp_min(1)  # B'
    if agg == "seq_mean_token_mean":
        return m * (n_i.clamp_min(1.0) * num_seqs).reciprocal()
    if agg == "seq_mean_token_sum":
        return m / num_seqs
    if agg == "seq_mean_token_sum_norm":
        length = float(mask.shape[-1] if norm_len is None else norm_len)
        if length <= 0:
            raise ValueError(f"norm_len must be positive, got {norm_len}")
        return m / (num_seqs * length)
    raise unknown_name_error("aggregation", agg, list(AGGREGATIONS))


class _Linearised(torch.autograd.Function):
    """`sum(a * (v + g * (x - sg(x))))`: the value `sum(a v)` and the gradient `a g` with respect to `x`."""

    @staticmethod
    def forward(ctx, x, value, coef, coeffs):
        if ctx.needs_input_grad[0]:
            grad = coef * coeffs  # [B, K]: d loss / d x, formed once in the forward pass
            ctx.save_for_backward(grad if grad.shape == x.shape else grad.sum_to_size(x.shape))
        if value.shape == coeffs.shape:
            return torch.dot(value.reshape(-1), coeffs.reshape(-1))
        return (value * coeffs).sum()

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad * grad_out, None, None, None


def linearised_loss(x: torch.Tensor, value: torch.Tensor, coef: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """The aggregated loss of a surrogate linearised at `x`: `sum(a * (v + g * (x - sg(x))))` in one dot product.

    `value` `v` and `coef` `g` are a surrogate's per-element value and its derivative in `x` (the log-ratio),
    `coeffs` `a` are `aggregation_weights` (times any per-element weights); all broadcast to `x`'s shape and carry
    no gradient (none flows to them).
    Equal in value and gradient to `aggregate(v + g * (x - x.detach()), ...)`, with a third of the tensor passes
    (one product and one dot forward, one product backward), which on long token batches is most of the loss's time.
    """
    return _Linearised.apply(x, value, coef, coeffs)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `x` over the elements where `mask` is set (0 where nothing is set)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population standard deviation of `x` over the elements where `mask` is set."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask).sqrt()
