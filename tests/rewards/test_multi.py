import math

import pytest
import torch

from flowrl import rewards
from flowrl.rewards import MultiReward, RewardError, combine_advantages
from flowrl.rewards.base import Reward


A = 1 / math.sqrt(2)


class Brightness(Reward):
    name = "brightness"
    differentiable = True

    def score(self, images, prompts, **metadata):
        return images.mean(dim=(1, 2, 3))


def test_weighted_sum_of_real_rewards_and_per_reward_scores():
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    images[0] = 0.5
    multi = MultiReward({"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5})
    out = multi.evaluate(images, ["a", "b"])
    size = rewards.get("jpeg_incompressibility")(images, ["a", "b"])
    torch.testing.assert_close(out.scores["jpeg_compressibility"], -size)
    torch.testing.assert_close(out.scores["jpeg_incompressibility"], size)
    torch.testing.assert_close(out.total, -0.5 * size)
    torch.testing.assert_close(multi(images, ["a", "b"]), out.total)
    assert not multi.differentiable


def test_each_reward_is_called_once_per_batch_and_aliases_work():
    calls = []

    def counting(images, prompts, **metadata):
        calls.append(len(prompts))
        return torch.arange(len(prompts), dtype=torch.float32)

    multi = MultiReward(
        {"count": 2.0, "big": 1.0, "small": -1.0},
        rewards={"count": counting},
        big={"name": "jpeg_incompressibility"},
        small={"name": "jpeg_incompressibility", "quality": 10},
    )
    images = torch.rand(5, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    out = multi.evaluate(images, list("abcde"))
    assert calls == [5]
    torch.testing.assert_close(out.total, 2 * torch.arange(5.0) + out.scores["big"] - out.scores["small"])
    assert (out.scores["big"] > out.scores["small"]).all()


def test_zero_weight_is_logged_only_and_its_nan_does_not_reach_the_total():
    multi = MultiReward(
        {"one": 1.0, "broken": 0.0},
        rewards={"one": lambda im, pr: [1.0, 2.0], "broken": lambda im, pr: [float("nan")] * 2},
    )
    out = multi.evaluate(torch.zeros(2, 3, 4, 4), ["a", "b"])
    torch.testing.assert_close(out.total, torch.tensor([1.0, 2.0]))
    assert torch.isnan(out.scores["broken"]).all()


def test_wrong_shapes_and_unknown_kwargs_name_the_reward():
    multi = MultiReward({"bad": 1.0}, rewards={"bad": lambda im, pr: [[1.0, 2.0]] * len(pr)})
    with pytest.raises(RewardError, match=r"reward 'bad' returned shape \(3, 2\); expected \[3\]"):
        multi(torch.zeros(3, 3, 4, 4), ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"kwargs for \['typo'\]"):
        MultiReward({"jpeg_compressibility": 1.0}, typo={"quality": 5})
    with pytest.raises(ValueError, match="unknown reward"):
        MultiReward({"no_such_reward": 1.0})


def test_differentiable_score_is_the_weighted_sum():
    multi = MultiReward({"b": 2.0, "c": -0.5}, rewards={"b": Brightness(), "c": Brightness()})
    assert multi.differentiable
    images = torch.rand(2, 3, 8, 8, requires_grad=True)
    multi.score(images, ["a", "b"]).sum().backward()
    torch.testing.assert_close(images.grad, torch.full_like(images, 1.5 / (3 * 8 * 8)))


SCORES = {"r1": torch.tensor([1.0, 3.0, 0.0, 0.0]), "r2": torch.tensor([10.0, 10.0, 2.0, 6.0])}
WEIGHTS = {"r1": 1.0, "r2": 0.5}
GROUPS = [0, 0, 1, 1]


def test_sum_mode_normalises_the_weighted_raw_sum():
    # total = r1 + 0.5 r2 = [6, 8, 1, 3]; each group is (mean -+ 1) with sample std sqrt(2)
    adv, stats = combine_advantages(SCORES, WEIGHTS, GROUPS, mode="sum", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-A, A, -A, A]))
    assert stats["num_groups"] == 2 and stats["zero_std_groups"] == 0


def test_gdpo_mode_normalises_each_reward_then_the_batch():
    # r1 -> [-a, a, 0, 0] (group 1 is flat), r2 -> [0, 0, -a, a]; combined = [-a, a, -a/2, a/2], a = 1/sqrt(2);
    # batch mean 0, population std a * sqrt(0.625)
    adv, stats = combine_advantages(SCORES, WEIGHTS, GROUPS, mode="gdpo", eps=0.0)
    expected = torch.tensor([-1.0, 1.0, -0.5, 0.5]) / math.sqrt(0.625)
    torch.testing.assert_close(adv, expected)
    assert stats["r1/zero_std_frac"] == 0.5 and stats["r2/zero_std_frac"] == 0.5
    assert stats["batch_std"] == pytest.approx(A * math.sqrt(0.625))
    clipped, _ = combine_advantages(SCORES, WEIGHTS, GROUPS, mode="gdpo", eps=0.0, clip=1.0)
    torch.testing.assert_close(clipped, expected.clamp(-1, 1))


def test_combine_advantages_checks_its_inputs():
    with pytest.raises(ValueError, match=r"no scores for \['r3'\]"):
        combine_advantages(SCORES, {"r3": 1.0}, GROUPS)
    with pytest.raises(ValueError, match="mode must be"):
        combine_advantages(SCORES, WEIGHTS, GROUPS, mode="mean")
    with pytest.raises(ValueError, match="different shapes"):
        combine_advantages({"r1": torch.zeros(4), "r2": torch.zeros(3)}, WEIGHTS, GROUPS)
    adv, _ = combine_advantages(SCORES, {"r1": 1.0, "r2": 0.0}, GROUPS, eps=0.0)  # weight 0: ignored
    torch.testing.assert_close(adv, torch.tensor([-A, A, 0.0, 0.0]))
