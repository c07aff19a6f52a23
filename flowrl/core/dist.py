"""Batch statistics over the global batch: sums and gathers across processes when `torch.distributed` runs.

Objectives whose loss depends on statistics of the whole batch (the entropy quantile of the 80/20 rule, BAPO's
contribution sums, the token covariance of Clip-Cov / KL-Cov, R2VPO's ratio variance, ESPO's groups are per
row and need none) compute them here, so every process uses the same statistic: the one of the concatenated
batch of all processes; the gradients of an unsharded run are summed here too (`sum_gradients`). With one process
(or no process group) these are the identity.
"""

from __future__ import annotations

import torch


def world_size() -> int:
    """Processes in the default group (1 without `torch.distributed`)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the processes (a new tensor; no gradient)."""
    x = x.detach().clone()
    if world_size() > 1:
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.SUM)
    return x


BUCKET_BYTES = 32 << 20
"""Gradient bytes summed per collective by `sum_gradients`: each collective's latency (about 2.5 ms between two CPU
processes on gloo, tens of microseconds on NCCL) paid once per bucket instead of once per tensor, and the most extra
memory the flat copy takes (DDP's buckets are 25 MiB)."""


def sum_gradients(params, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Every parameter's `.grad` summed over the processes, in place, one collective per bucket of consecutive
    gradients of one dtype and device. A missing gradient counts as zeros (a process whose share of the batch was
    empty); every process must pass the same parameters in the same order."""
    params = list(params)
    if world_size() == 1:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad, nbytes = p.grad, p.grad.numel() * p.grad.element_size()
        kind = (grad.dtype, grad.device)
        if bucket and (kind != (bucket[0].dtype, bucket[0].device) or size + nbytes > bucket_bytes):
            _sum_bucket(bucket)
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        _sum_bucket(bucket)


def _sum_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])  # [sum of numel]
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(part.view_as(grad))


def gather_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked-in entries of `values` of every process, concatenated in rank order (1-D, no gradient)."""
    local = values.detach()[mask.bool()].reshape(-1)
    world = world_size()
    if world == 1:
        return local
    dist = torch.distributed
    count = torch.tensor([local.numel()], device=local.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    longest = int(max(int(c) for c in counts))
    padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(c)] for p, c in zip(parts, counts)])
