"""What the text-trainer tests share: the tiny text config with dotted-key overrides, and a run resumed halfway
next to the uninterrupted one."""

import json

import torch

from flowrl.trainers import build_trainer
from tests.conftest import tiny_config


def tiny(**overrides):
    """The shared tiny text config (8 arith prompts x 4 completions of at most 4 tokens), dotted-key overrides."""
    return tiny_config("text", overrides=[f"{key}={json.dumps(value)}" for key, value in overrides.items()])


def full_and_resumed(tmp_path, overrides: dict, stop: int):
    """`(full, resumed)`: a run of `overrides` straight through, and one stopped after epoch `stop` (its checkpoint
    saved there) then resumed to the end in the same folder, `tmp_path / "part"`; their weights are asserted equal
    bit for bit (a test checks the state it cares about beside them)."""
    full = build_trainer(tiny(**overrides), output_dir=tmp_path / "full")
    full.train()
    build_trainer(tiny(**{**overrides, "run.epochs": stop}), output_dir=tmp_path / "part").train()
    resumed = build_trainer(tiny(**overrides), output_dir=tmp_path / "part")
    resumed.train(resume=True)
    for a, b in zip(full.params, resumed.params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return full, resumed
