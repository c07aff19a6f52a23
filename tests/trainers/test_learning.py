"""Learning, not just motion: each trainer's shipped digits recipe raises the held-out reward in a few epochs.

Slow (`pytest -m slow`): the real digits world (built into the flowrl cache on first use, about a minute) and
a few minutes of training in all. The margins are well inside what every seed reached when the recipes were
tuned (docs/algorithms/, benchmarks/results/digits_table.md), so a pass says "this trainer learns", and a
broken sign, scale or gradient path fails it.
"""

import statistics
from pathlib import Path

import pytest

from flowrl.trainers import build_trainer, load_config

from .conftest import training_rows


CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "digits"

# trainer, epochs, minimum rise of the held-out alignment reward (base model: about 0.57)
RUNS = [
    ("flow_grpo", 15, 0.10),
    ("grpo_guard", 15, 0.10),
    ("loop", 15, 0.10),
    ("dpok", 30, 0.05),
    ("find", 30, 0.05),
    ("acflow", 20, 0.05),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, epochs, margin", RUNS, ids=[r[0] for r in RUNS])
def test_the_held_out_reward_rises(name, epochs, margin, tmp_path):
    overrides = [
        f"run.epochs={epochs}",
        f"eval.every={epochs}",
        "run.log_with=[]",
        f"run.output_dir={tmp_path}",
        "run.save_every=0",
        "run.samples_every=0",
        "run.seed=0",
    ]
    summary = build_trainer(load_config(CONFIGS / f"{name}.yaml", overrides)).train()
    start, end = summary["reward_start"], summary["reward_end"]
    assert end >= start + margin, f"{name}: held-out reward {start:.3f} -> {end:.3f} after {epochs} epochs"
    # the training reward moved with it (the policy the epochs sampled improved, not only the evaluation)
    rows = training_rows(tmp_path)
    first, last = (statistics.mean(r["reward/mean"] for r in part) for part in (rows[:3], rows[-3:]))
    assert last > first, f"{name}: training reward {first:.3f} -> {last:.3f}"
