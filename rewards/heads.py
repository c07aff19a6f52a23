"""The linear MLP head shared by the LAION aesthetic predictor and ImageReward.

Both released heads are `nn.Sequential(Linear(d, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2),
Linear(128, 64), Dropout(0.1), Linear(64, 16), Linear(16, 1))` with no activations (the ReLUs are commented
out in the original code, so at inference the head is one affine map written as five). Their state dicts use
the keys `layers.{0,2,4,6,7}.{weight,bias}`. Sources: christophschuhmann/improved-aesthetic-predictor
(`simple_inference.py`), THUDM/ImageReward (`ImageReward.py`, class `MLP`).
"""

from __future__ import annotations

import re

import torch
from torch import nn


_KEY = re.compile(r"^layers\.(\d+)\.(weight|bias)$")


class MLPHead(nn.Module):
    """Linear layers at the given `nn.Sequential` indices, Dropout in the gaps, no activations.

    Args:
        dims (`list[int]`): feature sizes, e.g. `[768, 1024, 128, 64, 16, 1]`.
        linear_indices (`list[int]`, *optional*): the Sequential index of each Linear (defaults to the
            released layout `[0, 2, 4, 6, 7]` for five layers, else consecutive indices).
    """

    def __init__(self, dims: list[int], linear_indices: list[int] | None = None):
        super().__init__()
        n = len(dims) - 1
        if linear_indices is None:
            linear_indices = [0, 2, 4, 6, 7] if n == 5 else list(range(n))
        if len(linear_indices) != n:
            raise ValueError(f"{n} linear layers need {n} indices, got {linear_indices}")
        slots: list[nn.Module] = [nn.Dropout(0.0) for _ in range(max(linear_indices) + 1)]
        for k, index in enumerate(linear_indices):
            slots[index] = nn.Linear(dims[k], dims[k + 1])
        self.layers = nn.Sequential(*slots)
        self.in_features = dims[0]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], what: str = "head") -> MLPHead:
        """Build the head whose shapes match `state` (keys `layers.{i}.weight/bias`) and load it strictly."""
        indices = sorted({int(m.group(1)) for key in state if (m := _KEY.match(key))})
        if not indices or set(state) != {f"layers.{i}.{p}" for i in indices for p in ("weight", "bias")}:
            raise ValueError(
                f"{what}: expected only keys 'layers.<i>.weight' and 'layers.<i>.bias' (the released MLP head), "
                f"got {sorted(state)[:8]}"
            )
        weights = [state[f"layers.{i}.weight"] for i in indices]
        dims = [int(weights[0].shape[1])] + [int(w.shape[0]) for w in weights]
        for k, w in enumerate(weights):
            if w.ndim != 2 or w.shape[1] != dims[k]:
                raise ValueError(f"{what}: layer {indices[k]} has shape {tuple(w.shape)}, expected [*, {dims[k]}]")
        if dims[-1] != 1:
            raise ValueError(f"{what}: the last layer must output 1 value, it outputs {dims[-1]}")
        head = cls(dims, indices)
        head.load_state_dict(state, strict=True)
        return head


def strip_prefix(state: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Drop the first matching prefix (e.g. `module.`, `mlp.`) from every key that has one."""
    out = {}
    for key, value in state.items():
        for prefix in prefixes:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                break
        out[key] = value
    return out
