import pytest
import torch

from flowrl.config import ConfigError

from .conftest import make_trainer, tiny_config, training_rows


def test_loop_advantages_are_the_leave_one_out_baseline(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, tiny_config("loop", tmp_path))
    rewards = {"digits_alignment": torch.tensor([0.1, 0.5, 0.3, 0.9, 0.2, 0.2])}
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, _ = trainer.algorithm.estimator(rewards, groups, [str(g) for g in groups.tolist()])
    r = rewards["digits_alignment"]
    # sample 0: 0.1 - (0.5 + 0.3) / 2 = -0.3; sample 3: 0.9 - (0.2 + 0.2) / 2 = 0.7
    assert adv[0].item() == pytest.approx(-0.3) and adv[3].item() == pytest.approx(0.7)
    for i in range(6):
        others = [r[j] for j in range(6) if groups[j] == groups[i] and j != i]
        assert adv[i].item() == pytest.approx((r[i] - sum(others) / len(others)).item())
    assert torch.zeros(2).index_add_(0, groups, adv).abs().max() < 1e-6


def test_loop_trains_with_several_inner_epochs_and_resumes_exactly(tiny_world, tmp_path):
    straight = make_trainer(tiny_world, tiny_config("loop", tmp_path / "a", overrides=["run.epochs=3"]))
    before = [p.detach().clone() for p in straight.params]
    straight.train()
    assert all(not torch.equal(a, b) for a, b in zip(before, straight.params))
    first = make_trainer(tiny_world, tiny_config("loop", tmp_path / "b", overrides=["run.epochs=2"]))
    first.train()
    resumed = make_trainer(tiny_world, tiny_config("loop", tmp_path / "b", overrides=["run.epochs=3"]))
    resumed.train(resume=True)
    assert all(torch.equal(a, b) for a, b in zip(straight.params, resumed.params))
    record = training_rows(tmp_path / "a")[0]
    # 2 inner epochs over 16 samples in mini-batches of 16 (micro-batches of 8): 2 steps per epoch,
    # and the second pass sees ratios the first step moved
    assert record["trained_samples"] == 16 and record["ratio_std/step_0"] > 0


def test_loop_needs_groups_of_two_and_its_baseline():
    with pytest.raises(ConfigError, match="group_size >= 2"):
        tiny_config("loop", overrides=["prompts.group_size=1"])
    with pytest.raises(ConfigError, match="loop is defined by its leave-one-out baseline"):
        tiny_config("loop", overrides=["advantage.estimator=group"])


def test_loop_uses_the_advantage_settings(tiny_world, tmp_path):
    # std: group divides the leave-one-out advantage by the group's sample std; clip caps it
    trainer = make_trainer(
        tiny_world, tiny_config("loop", tmp_path, overrides=["advantage.std=group", "advantage.clip=1.0"])
    )
    r = torch.tensor([0.0, 1.0, 3.0])
    adv, _ = trainer.algorithm.estimator({"digits_alignment": r}, torch.zeros(3, dtype=torch.long), ["a"] * 3)
    std = r.std().item()  # unbiased, sqrt(7/3)
    expected = [max(-1.0, min(1.0, 1.5 * (x - 4 / 3) / (std + 1e-4))) for x in r.tolist()]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6) and adv.max() == 1.0
