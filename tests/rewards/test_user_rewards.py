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


def test_registration_names_the_class_once():
    """`@rewards.register("x")` is where a reward's name is written: the class gets it (its error messages say it),
    a class that sets another name is refused, and no built-in reward writes its name a second time."""
    import ast
    from pathlib import Path

    from flowrl.rewards.base import Reward

    @rewards.register("name_test_reward")
    class Named(Reward):
        def score(self, images, prompts, **metadata):
            return images.sum(dim=(1, 2, 3))

    try:
        assert Named.name == "name_test_reward" and rewards.get("name_test_reward").name == "name_test_reward"
        with pytest.raises(ValueError, match="reward 'name_test_reward' needs images"):
            rewards.get("name_test_reward")(torch.zeros(2, 1, 4, 4), ["a", "b"])
    finally:
        rewards.REWARDS.unregister("name_test_reward")

    class Other(Reward):
        name = "other"

    with pytest.raises(ValueError, match="sets name = 'other' but is registered as 'renamed'"):
        rewards.register("renamed", Other)
    assert "renamed" not in rewards.list_rewards() and Other.name == "other"

    written = []
    for path in Path(rewards.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            decorators = [d for d in getattr(node, "decorator_list", []) if isinstance(d, ast.Call)]
            if isinstance(node, ast.ClassDef) and any(getattr(d.func, "id", "") == "register" for d in decorators):
                names = [t.id for s in node.body if isinstance(s, ast.Assign) for t in s.targets if hasattr(t, "id")]
                written += [f"{path.name}: {node.name}" for n in names if n == "name"]
    assert not written, f"rewards that write their registered name twice: {written}"
    for name in rewards.list_rewards():
        factory = rewards.REWARDS.get(name)
        assert not isinstance(factory, type) or factory.name == name
