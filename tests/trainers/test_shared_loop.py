import json
import math

import pytest
import torch

from flowrl import rewards
from flowrl.checkpoint import CheckpointError
from flowrl.image.evaluate import group_diversity
from flowrl.run.driver import informative_groups

from .conftest import make_trainer, tiny_config, training_rows


def _weights(trainer):
    return [p.detach().clone() for p in trainer.params]


@pytest.mark.parametrize("name", ["flow_grpo", "grpo_guard"])
def test_two_epoch_run_trains_every_parameter_and_writes_the_run_folder(tiny_world, tmp_path, name):
    config = tiny_config(
        name,
        tmp_path,
        run={
            "epochs": 2,
            "save_every": 1,
            "samples_every": 1,
            "log_with": ["tensorboard"],
            "output_dir": str(tmp_path),
        },
    )
    trainer = make_trainer(tiny_world, config)
    before = _weights(trainer)
    summary = trainer.train()
    after = _weights(trainer)
    assert all(not torch.equal(a, b) for a, b in zip(before, after)), "some trainable parameter did not change"

    lines = training_rows(tmp_path)
    assert [r["epoch"] for r in lines] == [1, 2]
    for record in lines:
        for key in (
            "reward/mean",
            "reward/digits_alignment",
            "loss",
            "clipfrac",
            "clipfrac_high",
            "clipfrac_low",
            "approx_kl",
            "time_s",
            "grad_norm",
            "eval/digits_gold",
            "ratio_mean/step_0",
            "raw_ratio_std/step_0",
        ):
            assert key in record and math.isfinite(record[key]), key
    for key in ("reward_start", "reward_end", "gold_start", "gold_end", "epochs", "wall_s"):
        assert summary[key] is not None and math.isfinite(summary[key]), key
    assert json.loads((tmp_path / "summary.json").read_text())["epochs"] == 2
    assert (tmp_path / "config.yaml").is_file()
    assert list((tmp_path / "images").glob("epoch_*.png")) and (tmp_path / "plots" / "reward.png").is_file()
    assert list(tmp_path.rglob("events.out.tfevents.*")), "no TensorBoard events"
    assert (tmp_path / "checkpoints" / "epoch_2" / "manifest.json").is_file()


def test_resume_is_exact(tiny_world, tmp_path):
    straight = make_trainer(tiny_world, tiny_config("grpo_guard", tmp_path / "a", overrides=["run.epochs=4"]))
    straight.train()
    assert not (tmp_path / "a" / "plots").exists()  # the tiny configs draw no curves (run.plots: false)
    first = make_trainer(tiny_world, tiny_config("grpo_guard", tmp_path / "b", overrides=["run.epochs=2"]))
    first.train()
    resumed = make_trainer(tiny_world, tiny_config("grpo_guard", tmp_path / "b", overrides=["run.epochs=4"]))
    resumed.train(resume=True)
    for a, b in zip(_weights(straight), _weights(resumed)):
        assert torch.equal(a, b)
    history = lambda path: training_rows(path)  # noqa: E731
    a, b = history(tmp_path / "a"), history(tmp_path / "b")
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b] and len(b) == 4


def test_corrupt_or_partial_checkpoints_are_refused(tiny_world, tmp_path):
    make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=["run.epochs=1"])).train()
    ckpt = tmp_path / "checkpoints" / "epoch_1"
    weights = next(ckpt.rglob("model.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    trainer = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=["run.epochs=2"]))
    with pytest.raises(CheckpointError, match="model.safetensors is corrupt"):
        trainer.train(resume=True)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="is partial: it has no manifest.json"):
        trainer.train(resume=True)
    with pytest.raises(CheckpointError, match="does not exist"):
        trainer.train(resume=tmp_path / "checkpoints" / "epoch_9")


class Flaky:
    """The digits reward with NaN for the first `bad` samples of every call."""

    name = "flaky"

    def __init__(self, world, bad):
        self.inner, self.bad = rewards.get("digits_alignment", classifiers=world.classifiers), bad

    def __call__(self, images, prompts, **metadata):
        out = self.inner(images, prompts)
        out[: self.bad] = float("nan")
        return out


def test_nan_rewards_are_dropped_and_counted(tiny_world, tmp_path):
    config = tiny_config(
        "flow_grpo", tmp_path, overrides=["run.epochs=1", "eval.every=0"], rewards=[{"name": "flaky"}]
    )
    trainer = make_trainer(tiny_world, config, reward_fns={"flaky": Flaky(tiny_world, 1)})
    record = trainer.train_epoch(0)
    assert record["bad_rewards"] == 1 and record["bad_rewards/flaky"] == 1
    assert record["trained_samples"] <= 15 and math.isfinite(float(record["reward/mean"]))


def test_too_many_bad_rewards_abort_with_the_reward_name(tiny_world, tmp_path):
    config = tiny_config(
        "flow_grpo", tmp_path, overrides=["run.epochs=1", "run.max_bad_reward_frac=0.2"], rewards=[{"name": "flaky"}]
    )
    trainer = make_trainer(tiny_world, config, reward_fns={"flaky": Flaky(tiny_world, 5)})
    with pytest.raises(RuntimeError, match=r"31% of this epoch's rewards are NaN/inf \(flaky: 5 of 16"):
        trainer.train_epoch(0)


def test_kl_to_the_reference_and_gdpo_aggregation(tiny_world, tmp_path):
    config = tiny_config(
        "flow_grpo",
        tmp_path,
        overrides=["run.epochs=2", "kl.beta=0.1", "kl.form=gaussian"],
        reward_aggregation="gdpo",
        rewards=[{"name": "digits_alignment"}, {"name": "digits_gold", "weight": 0.5}],
    )
    trainer = make_trainer(tiny_world, config)
    assert trainer.policy.reference_model is not None  # full fine-tuning: a frozen copy
    trainer.train()
    history = training_rows(tmp_path)
    # epoch 1's two minibatches make one optimizer step after both: the policy is still the reference there
    assert history[0]["kl"] == 0 and history[1]["kl"] > 0  # the reference stays where training started
    assert "reward/digits_gold" in history[0]


def test_step_selections_and_sde_window(tiny_world, tmp_path):
    config = tiny_config(
        "flow_grpo", tmp_path, overrides=["steps.selection=random", "steps.k=2", "sampling.sde_window=[1, 3]"]
    )
    trainer = make_trainer(tiny_world, config)
    batch, _, _ = trainer.prepare_epoch(0)
    steps, _ = trainer.algorithm.elements(batch, 0)
    assert steps.shape == (len(batch.data), 2) and set(steps.flatten().tolist()) <= {1, 2}
    assert torch.equal(steps, trainer.algorithm.elements(batch, 0)[0])  # seeded by the epoch


def test_helpers():
    # groups whose advantages are all zero carry no signal
    groups = torch.tensor([0, 0, 1, 1])
    keep = informative_groups(groups, torch.tensor([0.0, 0.0, 1.0, -1.0]), torch.ones(4, dtype=torch.bool))
    assert keep.tolist() == [False, False, True, True]
    # diversity: identical samples 0; two groups of two images at RMS distance 1 and 0
    images = torch.stack([torch.zeros(3, 2, 2), torch.ones(3, 2, 2), torch.zeros(3, 2, 2), torch.zeros(3, 2, 2)])
    assert group_diversity(images, 2) == pytest.approx(0.5)


class Recording:
    """The digits reward, recording each call's batch size and thread."""

    def __init__(self, world):
        self.inner, self.calls = rewards.get("digits_alignment", classifiers=world.classifiers), []

    def __call__(self, images, prompts, **metadata):
        import threading

        self.calls.append((len(prompts), threading.current_thread().name))
        return self.inner(images, prompts)


@pytest.mark.parametrize("name", ["flow_grpo", "find"])
def test_rewards_are_scored_on_threads_while_later_parts_sample(tiny_world, tmp_path, name):
    config = tiny_config(name, tmp_path, overrides=["sampling.reward_overlap=3", "run.epochs=1"])
    reward = Recording(tiny_world)
    trainer = make_trainer(tiny_world, config, reward_fns={"digits_alignment": reward})
    batch = trainer.collector.collect(0)
    rollout, prompts, local, scores = batch.data, batch.prompts, batch.rows, batch.rewards
    assert len(rollout) == 16 and [n for n, _ in reward.calls] == [5, 5, 6]
    assert all(thread.startswith("flowrl-reward") for _, thread in reward.calls)
    assert {k for k in batch.times if k.startswith("time/")} == {"time/sample_s", "time/reward_s"}
    assert "memory/rollout_and_scoring_gb" in batch.times  # overlapped: one memory reading for both phases
    direct = trainer.modality.rewards.score(
        rollout.images, [prompts[i] for i in local], {"digits_alignment": reward.inner}
    )
    # the same scores as one call on the whole batch (up to the classifier's batch-size rounding)
    torch.testing.assert_close(scores["digits_alignment"], direct["digits_alignment"], rtol=1e-5, atol=1e-6)
    if name == "flow_grpo":  # the parts concatenate into one rollout that re-scores exactly
        steps = rollout.sde_steps
        assert torch.equal(trainer.policy.log_prob(rollout, steps.expand(16, -1)), rollout.log_probs[:, steps])
    assert torch.equal(trainer.collector.collect(0).data.latents, rollout.latents)  # seeded per part
    record = trainer.train_epoch(0)
    assert math.isfinite(float(record["loss"] if "loss" in record else record["reward/mean"]))


@pytest.mark.parametrize("overlap", [1, 2])
def test_a_reward_with_the_wrong_shape_is_named(tiny_world, tmp_path, overlap):
    config = tiny_config("flow_grpo", tmp_path, overrides=[f"sampling.reward_overlap={overlap}"])
    trainer = make_trainer(tiny_world, config, reward_fns={"digits_alignment": lambda images, prompts: [1.0, 2.0]})
    with pytest.raises(rewards.RewardError, match=r"reward 'digits_alignment' returned shape \(2,\); expected"):
        trainer.train_epoch(0)


def test_the_learning_rate_follows_the_schedule_per_epoch(tiny_world, tmp_path):
    overrides = ["run.epochs=3", "optim.schedule=linear", "optim.final_lr_ratio=0.5", "eval.every=0"]
    trainer = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=overrides))
    trainer.train()
    lrs = [r["lr"] for r in training_rows(tmp_path)]
    assert lrs == pytest.approx([1e-3, 7.5e-4, 5e-4])  # lr 1e-3 decaying linearly to half at the last epoch
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)


@pytest.mark.parametrize("metric", ["reward", "-digits_gold"])
def test_the_best_evaluation_is_kept_and_restored_at_the_end(tiny_world, tmp_path, metric):
    from safetensors.torch import load_file

    overrides = ["run.epochs=3", "eval.every=1", f"eval.best_metric={metric}", "eval.restore_best=true"]
    trainer = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=overrides))
    summary = trainer.train()
    name, sign = ("eval/reward", 1) if metric == "reward" else ("eval/digits_gold", -1)
    history = summary["eval_history"]
    best = max(history, key=lambda e: sign * e[name])
    assert summary["best"]["epoch"] == best["epoch"] and summary["best"]["value"] == best[name]
    assert summary["eval_end"] == {k: v for k, v in best.items() if k != "epoch"}
    saved = load_file(next((tmp_path / "checkpoints" / "best").rglob("model.safetensors")))
    final = load_file(next((tmp_path / "checkpoints" / "epoch_3").rglob("model.safetensors")))
    assert all(torch.equal(saved[k], final[k]) for k in saved)  # the final checkpoint holds the best weights
    restored = best["epoch"] != 3
    assert summary["best"].get("restored", False) == restored
    # the evaluation of the restored weights is the best one, exactly (fixed evaluation noise)
    evaluation = trainer.evaluate()
    assert evaluation[name] == pytest.approx(best[name], abs=1e-6)


def test_with_validation_prompts_the_best_is_chosen_on_them_and_the_test_set_is_reported(
    tiny_world, tmp_path, monkeypatch
):
    """`prompts.val`: each evaluation also scores the validation prompts (`val/...`); `eval.best_metric` selects on
    them, and the run reports the test set's numbers of the chosen epoch. Scripted rewards where the two sets
    disagree: the test set's best epoch (2) is not the validation set's (1)."""
    from flowrl.image.evaluate import ImageEvaluator

    scripted = {"eval": [0.1, 0.2, 0.9, 0.3], "val": [0.1, 0.8, 0.2, 0.5]}  # the evaluations of epochs 0-3
    seen = {"eval": [], "val": []}
    real = ImageEvaluator._evaluate

    def scripted_reward(self, prompts, prefix):
        out = real(self, prompts, prefix)
        seen[prefix].append([str(p) for p in prompts])
        out[f"{prefix}/reward"] = scripted[prefix][len(seen[prefix]) - 1]
        return out

    monkeypatch.setattr(ImageEvaluator, "_evaluate", scripted_reward)
    (tmp_path / "val.txt").write_text("a seven, handwritten\npen drawing of the number 3\n")
    val = f"prompts.val={tmp_path / 'val.txt'}"
    overrides = ["run.epochs=3", "eval.every=1", "eval.best_metric=reward", "eval.restore_best=true", val]
    summary = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path / "run", overrides=overrides)).train()
    assert seen["val"] == [["a seven, handwritten", "pen drawing of the number 3"]] * 4
    assert "a seven, handwritten" not in seen["eval"][0]  # the test prompts are the test set's own
    assert summary["best"] == {"epoch": 1, "metric": "val/reward", "value": 0.8, "restored": True}
    assert summary["reward_end"] == 0.2  # the test set's reward of the chosen epoch (its own best, 0.9, unused)
    assert {"val/reward", "val/digits_gold", "eval/reward", "eval/digits_gold"} <= set(summary["eval_history"][0])


def test_best_metric_must_be_an_evaluation_metric(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=["eval.best_metric=gold"]))
    with pytest.raises(ValueError, match="eval.best_metric 'gold' is not an evaluation metric; choose from"):
        trainer.train()


@pytest.mark.parametrize("setting", [1, "auto"])
def test_run_threads_sets_and_records_the_thread_count(tiny_world, tmp_path, monkeypatch, setting):
    monkeypatch.delenv("FLOWRL_THREADING", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        config = tiny_config("flow_grpo", tmp_path, ["run.epochs=1", f"run.threads={setting}"])
        trainer = make_trainer(tiny_world, config)
        trainer.engine.threads.min_interval_s = 0.0  # judge the load over however long the model took to build
        trainer.train()
        row = training_rows(tmp_path)[0]
        assert row["threads"] == torch.get_num_threads()
        if setting == 1:
            assert row["threads"] == 1 and not trainer.engine.threads.active
        else:
            assert 1 <= row["threads"] <= trainer.engine.threads.max_threads
    finally:
        torch.set_num_threads(before)
