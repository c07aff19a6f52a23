"""User rewards: a plain function by dotted path, output checks that name the reward."""

import textwrap

import pytest
import torch

from flowrl import rewards
from flowrl.rewards import RewardError, check_output


MODULE = textwrap.dedent(
    """
    import torch

    def brightness(images, prompts, **metadata):
        return images.mean(dim=(1, 2, 3)).tolist()

    def two_columns(images, prompts, **metadata):
        return torch.zeros(len(prompts), 2)

    def sometimes_nan(images, prompts, **metadata):
        return [float("nan")] + [1.0] * (len(prompts) - 1)

    class Scaled:
        def __init__(self, factor=1.0):
            self.factor = factor

        def __call__(self, images, prompts, **metadata):
            return torch.full((len(prompts),), self.factor)
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "flowrl_user_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "flowrl_user_rewards"


def test_plain_function_by_dotted_path(user_module):
    fn = rewards.get(f"{user_module}:brightness")
    images = torch.rand(3, 3, 4, 4)
    scores = check_output(f"{user_module}:brightness", fn(images, ["a", "b", "c"]), 3)
    torch.testing.assert_close(scores, images.mean(dim=(1, 2, 3)))
    assert rewards.get(f"{user_module}:Scaled", factor=2.0)(images, list("abc")).tolist() == [2.0] * 3


def test_wrong_shape_names_the_reward_and_nan_passes_through(user_module):
    name = f"{user_module}:two_columns"
    with pytest.raises(RewardError, match=rf"reward '{name}' returned shape \(3, 2\); expected \[3\]"):
        check_output(name, rewards.get(name)(torch.zeros(3, 3, 2, 2), list("abc")), 3)
    scores = check_output("nan", rewards.get(f"{user_module}:sometimes_nan")(None, list("abc")), 3)
    assert torch.isnan(scores[0]) and scores[1:].tolist() == [1.0, 1.0]  # the trainer counts and drops NaN


def test_user_rewards_mix_with_built_in_ones(user_module):
    multi = rewards.MultiReward({f"{user_module}:brightness": 1.0, "jpeg_incompressibility": 0.0})
    images = torch.rand(2, 3, 8, 8)
    torch.testing.assert_close(multi(images, ["a", "b"]), images.mean(dim=(1, 2, 3)))


def test_bad_dotted_paths():
    with pytest.raises(ValueError, match="cannot import module"):
        rewards.get("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute"):
        rewards.get("flowrl.rewards.jpeg:nope")
