"""Faults a long run survives: non-finite gradients are skipped and counted (and stop the run past a limit), a
reward that raises mid-run ends it with a clear error and leaves the last checkpoint loadable."""

import json
import math

import pytest
import torch

from flowrl.core.terms import Terms
from flowrl.rewards import RewardError
from flowrl.run.engine import NonFiniteError

from .conftest import make_trainer, tiny_config


def poisoned(trainer, bad_calls: set[int]):
    """Make the algorithm's `terms` calls numbered in `bad_calls` (0-based) return a NaN log-probability."""
    score, calls = trainer.algorithm.terms, [0]

    def score_with_nan(batch, index) -> Terms:
        terms = score(batch, index)
        if calls[0] in bad_calls:
            terms.logp = terms.logp * float("nan")  # keeps the graph: the gradient is NaN too
        calls[0] += 1
        return terms

    trainer.algorithm.terms = score_with_nan


def _rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_loss_skips_its_step_is_counted_and_the_weights_stay_finite(tiny_world, tmp_path):
    overrides = ["run.epochs=2", "run.samples_every=0", "optim.max_nonfinite_steps=3"]
    clean = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path / "clean", overrides=overrides))
    clean.train()
    trainer = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path / "nan", overrides=overrides))
    before = [p.detach().clone() for p in trainer.params]
    poisoned(trainer, bad_calls={0})  # the first micro-batch of epoch 1: its mini-batch's step is skipped
    trainer.train()
    rows = _rows(tmp_path / "nan")
    assert [r["nonfinite_steps"] for r in rows[1:]] == [1, 1]
    for phase in ("rollout", "scoring", "update"):  # each phase's memory is logged (resident set on CPUs)
        assert rows[1][f"memory/{phase}_gb"] > 0.01, phase
    assert trainer.engine.optimizer_steps == clean.engine.optimizer_steps - 1
    assert all(torch.isfinite(p).all() for p in trainer.params)
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.params))  # the other steps trained


def test_too_many_nan_steps_stop_the_run_and_keep_its_last_checkpoint(tiny_world, tmp_path):
    def config(epochs):
        return tiny_config(
            "flow_grpo",
            tmp_path,
            overrides=[f"run.epochs={epochs}", "run.samples_every=0", "optim.max_nonfinite_steps=1"],
        )

    make_trainer(tiny_world, config(2)).train()
    again = make_trainer(tiny_world, config(4))
    poisoned(again, bad_calls=set(range(1000)))  # every step from here on is NaN (one step per epoch)
    with pytest.raises(NonFiniteError, match="2 optimizer steps .* by epoch 4, more than optim.max_nonfinite_steps=1"):
        again.train(resume=True)  # epoch 3 skips its step and saves; epoch 4's skip is one too many
    assert (tmp_path / "checkpoints" / "epoch_3").is_dir() and not (tmp_path / "checkpoints" / "epoch_4").exists()
    resumed = make_trainer(tiny_world, config(4))
    resumed.train(resume=True)  # the last checkpoint loads and the run finishes
    assert resumed.epoch == 4 and all(torch.isfinite(p).all() for p in resumed.params)


def test_a_reward_raising_mid_run_names_itself_and_keeps_the_last_checkpoint(tiny_world, tmp_path):
    overrides = ["run.epochs=3", "run.samples_every=0", "eval.every=0"]
    trainer = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=overrides))
    name, fn = next(iter(trainer.modality.rewards.fns.items()))
    calls = [0]

    def flaky(images, prompts, **metadata):
        calls[0] += 1  # 1: the baseline evaluation, 2 and 3: epochs 1 and 2, 4: epoch 3
        if calls[0] == 4:
            raise ConnectionError("reward server went away")
        return fn(images, prompts, **metadata)

    trainer.modality.rewards.fns[name] = flaky
    with pytest.raises(RewardError, match=f"reward {name!r} failed: ConnectionError: reward server went away"):
        trainer.train()
    assert (tmp_path / "checkpoints" / "epoch_2").is_dir() and not (tmp_path / "checkpoints" / "epoch_3").exists()
    resumed = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=overrides))
    assert resumed.train(resume=True)["epochs"] == 3
    assert math.isfinite(_rows(tmp_path)[-1]["reward/mean"])


def test_a_checkpoint_of_another_trainer_or_model_config_is_refused(tiny_world, tmp_path):
    from flowrl import rewards
    from flowrl.checkpoint import CheckpointMismatch
    from flowrl.trainers import build_trainer

    overrides = ["run.epochs=2", "run.samples_every=0"]
    first = tiny_config("flow_grpo", tmp_path, overrides=["run.epochs=1", "run.samples_every=0"])
    make_trainer(tiny_world, first).train()
    other = make_trainer(tiny_world, tiny_config("grpo_guard", tmp_path, overrides=overrides))
    with pytest.raises(CheckpointMismatch, match="is from trainer 'flow_grpo', not 'grpo_guard'"):
        other.train(resume=True)

    config = tiny_config("flow_grpo", tmp_path, overrides=overrides)
    policy = tiny_world.policy(forward_batch_size=config.batch.micro_batch_size)
    policy.add_lora(rank=4)  # a LoRA run resuming a full-weights checkpoint
    fns = {name: rewards.get(name, classifiers=tiny_world.classifiers) for name in ("digits_alignment", "digits_gold")}
    lora = build_trainer(
        config,
        policy=policy,
        reward_fns={"digits_alignment": fns["digits_alignment"]},
        eval_fns={"digits_gold": fns["digits_gold"]},
    )
    with pytest.raises(CheckpointMismatch, match="does not fit this run's model or optimizer") as err:
        lora.train(resume=True)
    assert "previous verified checkpoint" not in str(err.value)  # an older one would not fit either


def test_a_lora_target_that_does_not_exist_names_the_real_layers(tiny_world):
    policy = tiny_world.policy()
    with pytest.raises(ValueError, match=r"lora_targets \['to_qq'\] match no module of the SD3Transformer2DModel"):
        policy.add_lora(rank=4, target_modules=["to_q", "to_qq"])
    policy.add_lora(rank=4, target_modules=["to_q"])  # a real one still works


@pytest.mark.parametrize(
    "scores",
    [
        torch.tensor([0.5, 1.0], dtype=torch.float16),
        torch.tensor([0.5, 1.0], dtype=torch.float64),
        torch.tensor([0, 1]),
        torch.tensor([False, True]),
        [0.5, 1.0],
        torch.tensor([[0.5], [1.0]]),
    ],
)
def test_rewards_of_any_numeric_dtype_become_fp32_on_the_cpu(scores):
    from flowrl.rewards.scoring import call_reward

    out = call_reward("r", lambda: scores, 2)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == (2,)


def test_rewards_returning_non_numbers_or_the_wrong_count_are_named():
    from flowrl.rewards.scoring import call_reward

    with pytest.raises(RewardError, match="reward 'r' returned list, not numbers"):
        call_reward("r", lambda: ["good", "bad"], 2)
    with pytest.raises(RewardError, match=r"reward 'r' returned shape \(3,\); expected \[2\]"):
        call_reward("r", lambda: torch.zeros(3), 2)


class _Payload:
    """Unpickled without `weights_only`, this would create a file: the shape of a malicious checkpoint."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_checkpoint_with_pickled_code_is_refused_and_the_code_never_runs(tiny_world, tmp_path):
    from flowrl import checkpoint

    make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=["run.epochs=1"])).train()
    folder = tmp_path / "checkpoints" / "epoch_1"
    marker = tmp_path / "pwned"
    torch.save({"state": _Payload(marker), "param_groups": []}, folder / "accelerate" / "optimizer.bin")
    checkpoint.write_manifest(folder)  # even with a manifest that matches the tampered file
    again = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path, overrides=["run.epochs=2"]))
    with pytest.raises(checkpoint.CheckpointError, match="holds pickled objects that are not plain tensors") as info:
        again.train(resume=True)
    assert not marker.exists()
    # the message ends in a whole sentence naming what was refused (torch's own opens with 200 characters of advice)
    assert str(info.value).endswith(
        "never unpickles code): it names io.open, which the weights-only loader does not import."
    ), str(info.value)


def test_reference_offload_keeps_the_copy_on_the_cpu_between_passes_and_changes_no_number(tiny_world, tmp_path):
    overrides = ["run.epochs=1", "kl.beta=0.1", "run.samples_every=0", "eval.every=0", "batch.mini_batch_size=8"]
    plain = make_trainer(tiny_world, tiny_config("flow_grpo", tmp_path / "plain", overrides=overrides))
    offload = make_trainer(
        tiny_world, tiny_config("flow_grpo", tmp_path / "offload", overrides=[*overrides, "kl.reference_offload=true"])
    )
    reference, moves = offload.policy.reference_model, []
    to = reference.to

    def recording_to(device, *args, **kwargs):
        moves.append(str(device))
        return to(device, *args, **kwargs)

    reference.to = recording_to
    a, b = plain.train_epoch(0), offload.train_epoch(0)
    assert float(a["kl"]) == float(b["kl"]) > 0 and float(a["loss"]) == float(b["loss"])
    device = str(offload.policy.device)
    assert moves and moves[::2] == [device] * (len(moves) // 2) and moves[1::2] == ["cpu"] * (len(moves) // 2)
    assert all(p.device.type == "cpu" for p in reference.parameters())
