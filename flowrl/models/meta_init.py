"""Real-size networks built without their initial draws: on `meta` (or as fake tensors under a `FakeTensorMode`) a
tensor holds no values, yet torch still runs each `torch.nn.init` draw through its Python reference kernels (the
`nn.Linear`s' and LoRA layers' `reset_parameters`): ~18% of a shipped recipe's meta assembly (2 CPU cores)."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor


INITIALISERS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)
"""The `torch.nn.init` functions that write a tensor's values in place."""


def _holds_no_data(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and (tensor.device.type == "meta" or isinstance(tensor, FakeTensor))


def _skipping(init):
    @functools.wraps(init)
    def initialise(tensor, *args, **kwargs):
        if _holds_no_data(tensor):  # nothing to write: the draw would only cost time
            return tensor
        return init(tensor, *args, **kwargs)

    return initialise


@contextlib.contextmanager
def no_init_without_data():
    """Within: `torch.nn.init`'s initialisers return a `meta` or fake tensor unchanged (a real one is drawn as
    before). No generator is drawn from either way: `meta` and fake tensors' draws never touch it."""
    originals = {name: getattr(torch.nn.init, name) for name in INITIALISERS}
    for name, init in originals.items():
        setattr(torch.nn.init, name, _skipping(init))
    try:
        yield
    finally:
        for name, init in originals.items():
            setattr(torch.nn.init, name, init)
