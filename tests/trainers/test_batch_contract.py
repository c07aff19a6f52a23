"""The batch contract on shipped configs: the micro-batch size bounds memory and changes nothing else.

Each shipped digits config trains as shipped (its prompts, groups, steps, mini-batches, inner epochs, objective)
on the tiny world's model, once with its own `batch.micro_batch_size` and once with a smaller one: the same number
of optimizer steps, the same per-step statistics and the same weights, up to floating-point reduction order.
(1 vs 2 processes: `tests/test_distributed.py`, the `distributed` tier.)
"""

from pathlib import Path

import pytest
import torch

from flowrl.trainers import build_trainer, load_config

from .conftest import make_trainer


CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHORT = ["run.epochs=1", "eval.every=0", "run.samples_every=0", "run.save_every=0", "run.log_with=[]"]
"""One epoch, nothing but the update: the algorithm stays as shipped."""

STATISTICS = ("loss", "pg_loss", "clipfrac", "approx_kl", "ratio_mean", "grad_norm")


def _epoch(world, path, tmp_path, micro: int | None):
    """One epoch of a shipped config (digits: on the tiny world's model) with `micro` (None: as shipped)."""
    overrides = [*SHORT, f"run.output_dir={tmp_path}"]
    if micro is not None:
        overrides.append(f"batch.micro_batch_size={micro}")
    if path.parent.name == "control":
        overrides = [o for o in overrides if not o.startswith(("run.samples_every", "run.save_every"))]
        overrides += ["total_env_steps=null"]
    config = load_config(path, overrides)
    digits = path.parent.name == "digits"
    trainer = make_trainer(world, config) if digits else build_trainer(config, output_dir=tmp_path)
    record = trainer.train_epoch(0)
    return config, record, [p.detach().clone() for p in trainer.params]


@pytest.mark.parametrize(
    ("name", "micro"),
    [
        ("digits/grpo_guard", 8),
        ("digits/loop", 16),
        ("digits/dpok", 8),
        ("digits/diffusion_nft", 8),
        ("control/pendulum_ppo", 16),
        ("llm/arith_grpo", 8),
    ],
)
def test_a_smaller_micro_batch_changes_no_step_of_a_shipped_config(tiny_world, tmp_path, name, micro):
    if name.startswith("control"):
        pytest.importorskip("gymnasium")
    path = CONFIGS / f"{name}.yaml"
    config, shipped, weights = _epoch(tiny_world, path, tmp_path / "shipped", None)
    assert config.batch.micro_batch_size != micro
    _, small, small_weights = _epoch(tiny_world, path, tmp_path / "small", micro)
    assert shipped["optimizer_steps"] == small["optimizer_steps"] >= 2
    # the same samples (episodes, completions), up to reduction order: the chunk size changes the matmul blocking
    assert float(small["reward/mean"]) == pytest.approx(float(shipped["reward/mean"]), rel=1e-5, abs=1e-7)
    for key in STATISTICS:
        if key in shipped:
            assert small[key] == pytest.approx(shipped[key], rel=1e-4, abs=1e-6), key
    assert any(shipped.get(k) for k in ("clipfrac", "loss"))  # the update did something the sweep could change
    for a, b in zip(weights, small_weights):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_a_micro_batch_that_does_not_divide_the_mini_batch_trains_the_same(tiny_world, tmp_path):
    """The rule for a size that does not divide the work: the last micro-batch is smaller and each micro-batch's
    loss is scaled by its share of the mini-batch's normaliser, so nothing changes (docs/distributed.md)."""
    path = CONFIGS / "digits" / "grpo_guard.yaml"
    _, shipped, weights = _epoch(tiny_world, path, tmp_path / "shipped", None)
    _, odd, odd_weights = _epoch(tiny_world, path, tmp_path / "odd", 24)  # 64 = 24 + 24 + 16
    assert shipped["optimizer_steps"] == odd["optimizer_steps"]
    for a, b in zip(weights, odd_weights):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
