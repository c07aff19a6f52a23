"""Pref-GRPO's in-group win rates (`rewards/pairwise.py`): the arithmetic and the invariants of the reference notes."""

import pytest
import torch

from flowrl import rewards
from flowrl.rewards.pairwise import PairwiseWinRate


def _images(n):
    # image i is uniformly i / 10: a judge can read the sample index back from the pixels
    return torch.arange(n, dtype=torch.float32).div(10).view(n, 1, 1, 1).expand(n, 3, 4, 4).clone()


def _index(images):
    return (images[:, 0, 0, 0] * 10).round().long()


class CountingJudge:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, first, second, prompts):
        self.calls += len(prompts)
        return self.fn(_index(first), _index(second))


def test_a_judge_that_prefers_the_first_image_exposes_position_bias_unless_both_orders():
    g = 5
    judge = CountingJudge(lambda i, j: torch.ones(len(i)))
    w = PairwiseWinRate(judge=judge)(_images(g), ["p"] * g)
    assert judge.calls == g * (g - 1) // 2  # every unordered pair judged once
    torch.testing.assert_close(w, torch.tensor([(g - 1 - i) / (g - 1) for i in range(g)]))
    w2 = PairwiseWinRate(judge=judge, both_orders=True)(_images(g), ["p"] * g)
    torch.testing.assert_close(w2, torch.full((g,), 0.5))


def test_win_rates_sum_to_half_the_group_and_ties_give_one_half():
    prompts = ["a"] * 4 + ["b"] * 3 + ["c"]
    better = CountingJudge(lambda i, j: (i > j).float())  # the higher index wins
    w = PairwiseWinRate(judge=better)(_images(8), prompts)
    torch.testing.assert_close(w[:4], torch.tensor([0.0, 1 / 3, 2 / 3, 1.0]))
    torch.testing.assert_close(w[4:7], torch.tensor([0.0, 0.5, 1.0]))
    assert float(w[7]) == 0.5  # a one-sample group has no opponent
    assert float(w[:4].sum()) == pytest.approx(2.0) and float(w[4:7].sum()) == pytest.approx(1.5)
    tie = PairwiseWinRate(judge=CountingJudge(lambda i, j: torch.full((len(i),), 0.5)))
    torch.testing.assert_close(tie(_images(8), prompts), torch.full((8,), 0.5))


def test_a_pointwise_reward_becomes_a_judge_by_score():
    reward = PairwiseWinRate(score="tests.rewards.test_pairwise:brightness")
    images = _images(4)[[2, 0, 3, 3]]  # two equal images tie with each other
    w = reward(images, ["p"] * 4)
    # sample 0 beats 1; 2 and 3 beat 0 and 1 and tie with each other
    torch.testing.assert_close(w, torch.tensor([1 / 3, 0.0, 2.5 / 3, 2.5 / 3]))
    margin = PairwiseWinRate(score="tests.rewards.test_pairwise:brightness", tie_margin=0.15)
    torch.testing.assert_close(margin(images, ["p"] * 4), torch.tensor([2 / 3, 0.0, 2 / 3, 2 / 3]))  # 0.1 apart: ties


def brightness(images, prompts, **_):
    return images.mean(dim=(1, 2, 3))


def test_registered_and_bad_input_is_named():
    assert "pairwise_winrate" in rewards.list_rewards()
    with pytest.raises(ValueError, match="exactly one of judge"):
        rewards.get("pairwise_winrate")
    bad = PairwiseWinRate(judge=lambda a, b, p: torch.full((len(p),), 2.0))
    with pytest.raises(ValueError, match="probabilities in \\[0, 1\\]"):
        bad(_images(3), ["p"] * 3)
