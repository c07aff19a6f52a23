"""Rollouts and weights as safetensors blobs (`flowrl.run.wire`): what the asynchronous mode sends."""

import dataclasses

import pytest
import torch

from flowrl.policies.diffusion_rollout import DiffusionRollout
from flowrl.policies.rollout import Collected
from flowrl.prompts import Prompt
from flowrl.run import wire


def _collected() -> Collected:
    rollout = DiffusionRollout(
        prompts=["a 3", "a 7"],
        prompt_ids=torch.tensor([0, 1]),
        latents=torch.randn(2, 3, 1, 8, 8),
        log_probs=torch.randn(2, 2),
        unique_prompts=["a 3", "a 7"],
        sampler="flow_sde",
        noise_level=0.7,
        sigmas=torch.tensor([1.0, 0.5, 0.0]),
        cond={"prompt_embeds": torch.randn(2, 4, 5)},
        static={"shift": 1.0},
    )
    return Collected(
        data=rollout,
        rows=torch.arange(2),
        size=2,
        prompts=[Prompt("a 3", {"digit": 3}), Prompt("a 7", {"digit": 7})],
        rewards={"digits_alignment": torch.tensor([0.25, float("nan")])},
        total=torch.tensor([0.25, 0.5]),
        times={"time/sample_s": 1.5},
        info={"returns": [1.0, 2.0], "nested": {"n": (1, 2)}},
    )


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.nan_to_num(-7), b.nan_to_num(-7))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_a_collected_batch_travels_unchanged():
    collected = _collected()
    blob = wire.encode(collected, epoch=3, version=2, modality={"obs.mean": torch.ones(3)})
    assert isinstance(blob, bytes)
    back, header = wire.decode(blob)
    assert _same(back, collected)
    assert header["epoch"] == 3 and header["version"] == 2
    assert torch.equal(header["modality"]["obs.mean"], torch.ones(3))


def test_weights_travel_as_a_dict_of_tensors():
    weights = {"blocks.0.weight": torch.randn(4, 4), "blocks.0.bias": torch.zeros(4, dtype=torch.bfloat16)}
    back, _ = wire.decode(wire.encode({"weights": weights, "modality": {}}))
    assert _same(back["weights"], weights) and back["modality"] == {}


def test_foreign_or_damaged_blobs_are_refused():
    blob = wire.encode(_collected())
    forged = blob.replace(b"flowrl.policies.diffusion_rollout:DiffusionRollout", b"os:system" + b" " * 41)
    with pytest.raises(wire.WireError, match="may only name flowrl's records"):
        wire.decode(forged)
    with pytest.raises(wire.WireError, match="not a flowrl rollout blob"):
        wire.decode(blob[:100])
    with pytest.raises(wire.WireError, match="cannot send a object"):
        wire.encode({"x": object()})
    with pytest.raises(wire.WireError, match="source images must be paths"):
        wire.encode([Prompt("edit", images=(object(),))])
