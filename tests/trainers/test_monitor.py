"""The over-optimisation monitor: proxy-gold divergence, the early-stop rule and the best checkpoint."""

import json

import pytest

from flowrl.sections import EvalConfig

from .conftest import make_trainer, tiny_config


def scripted(trainer, golds, proxies):
    """Replace the evaluator by a script: evaluation i returns `golds[i]` and `proxies[i]`."""
    calls = iter(zip(golds, proxies))

    def evaluate():
        gold, proxy = next(calls)
        return {"eval/digits_gold": gold, "eval/reward": proxy}

    trainer.evaluate = evaluate


def test_gold_falling_stops_the_run_and_the_best_checkpoint_is_restored(tiny_world, tmp_path):
    overrides = [
        "run.epochs=6",
        "run.save_every=0",
        "run.samples_every=0",
        "eval.best_metric=digits_gold",
        "eval.stop_on_drop=0.15",
        "eval.restore_best=true",
    ]
    trainer = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=overrides))
    # epochs 0..4: gold peaks at epoch 2 while the proxy keeps rising; at epoch 4 it is 0.2 below its best
    scripted(trainer, golds=[0.5, 0.6, 0.7, 0.6, 0.5, 0.9], proxies=[0.1, 0.2, 0.3, 0.5, 0.8, 0.9])
    summary = trainer.train()
    assert summary["epochs"] == 4 and summary["stopped"] == {
        "epoch": 4,
        "metric": "eval/digits_gold",
        "best": 0.7,
        "value": 0.5,
    }
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("overopt/gold_drop") for r in rows[1:]] == pytest.approx([0.0, 0.0, 0.1, 0.2])
    assert [r.get("overopt/proxy_gain") for r in rows[1:]] == pytest.approx([0.0, 0.0, 0.2, 0.5])
    assert summary["best"]["epoch"] == 2 and summary["best"]["restored"]
    assert (tmp_path / "checkpoints" / "best").is_dir() and (tmp_path / "checkpoints" / "epoch_4").is_dir()
    # resuming a stopped run trains no further
    again = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=overrides))
    assert again.train(resume=True)["epochs"] == 4


def test_without_stop_on_drop_the_run_goes_on_and_lower_is_better_metrics_count_down(tiny_world, tmp_path):
    overrides = ["run.epochs=3", "run.save_every=0", "run.samples_every=0", "eval.best_metric=-digits_gold"]
    trainer = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=overrides))
    scripted(trainer, golds=[1.5, 1.2, 1.4, 1.6], proxies=[0.1, 0.2, 0.3, 0.4])
    summary = trainer.train()
    assert summary["epochs"] == 3 and summary["stopped"] is None and summary["best"]["epoch"] == 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["overopt/gold_drop"] == pytest.approx(0.4) and rows[-1]["overopt/proxy_gain"] == pytest.approx(0.2)


def test_stop_on_drop_needs_a_metric_and_a_positive_amount():
    with pytest.raises(ValueError, match="stop_on_drop needs eval.best_metric"):
        EvalConfig(stop_on_drop=0.1)
    with pytest.raises(ValueError, match="positive amount"):
        EvalConfig(best_metric="digits_gold", stop_on_drop=0.0)
