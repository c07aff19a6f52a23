"""Host-to-device copies that do not wait for the device.

A blocking copy of host memory to a GPU (`.to("cuda")` of a CPU tensor, or indexing a GPU tensor with CPU indices,
which copies them so) waits for every kernel queued before it: in a loop over denoising steps or micro-batches the
host then stops feeding the GPU at each copy. `to_device` queues such a copy behind the kernels instead
(`non_blocking`; the CUDA driver stages pageable memory before the call returns, so the source may be freed). A copy
to the CPU stays blocking: its values are read on the host at once. `tests/policies/test_no_sync.py` records any
blocking copy left in a rollout or an update step.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`, copied there without waiting for the device unless `device` is the CPU."""
    device = torch.device(device)
    return tensor.to(device, non_blocking=device.type != "cpu")
