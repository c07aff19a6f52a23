"""Batch statistics over the global batch: sums and gathers across processes when `torch.distributed` runs.

Objectives whose loss depends on statistics of the whole batch (the entropy quantile of the 80/20 rule, BAPO's
contribution sums, the token covariance of Clip-Cov / KL-Cov, R2VPO's ratio variance, ESPO's groups are per
row and need none) compute them here, so every process uses the same statistic: the one of the concatenated
batch of all processes. With one process (or no process group) these are the identity.
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
