"""Per-step gradient norms: what each backward pass adds to the parameters' gradients (`step_grad_norms_every`)."""

from __future__ import annotations

import torch


class GradProbe:
    """The norm of what each backward pass adds to the parameters' gradients (per-step gradient norms)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        self.before: list[torch.Tensor | None] = []

    def reset(self) -> None:
        """Remember the gradients as they are now."""
        self.before = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    def increment_norm(self) -> float:
        """`||grad - grad at the last call||` (fp32), and remember the gradients as they are now."""
        total = torch.zeros((), dtype=torch.float32)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad.detach()
            delta = grad if self.before[i] is None else grad - self.before[i]
            total += delta.float().square().sum().cpu()
            self.before[i] = grad.clone()
        return float(total.sqrt())
