"""docs/rewards.md stays true to the code: every built-in reward, prompt set and argument default it names."""

import inspect
from pathlib import Path

from flowrl import prompts, rewards


DOC = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()


def test_every_registered_reward_is_documented():
    shipped = [n for n in rewards.list_rewards() if rewards.REWARDS.get(n).__module__.startswith("flowrl.rewards.")]
    assert len(shipped) >= 10
    for name in shipped:  # the registry is the list: every module of flowrl.rewards registers its rewards
        assert f"| `{name}` |" in DOC, f"docs/rewards.md has no table row for {name}"
        description = rewards.REWARDS.describe()[name]
        if not name.startswith(("digits_", "arith_")):  # the offline worlds' rewards need nothing to download
            assert "needs" in description, f"{name}'s description must say what it needs"


def test_documented_hub_ids_and_defaults_match_the_code():
    for name in ["aesthetic", "clip_score", "pickscore", "hpsv2", "imagereward"]:
        for param in inspect.signature(rewards.REWARDS.get(name)).parameters.values():
            if isinstance(param.default, str) and "/" in param.default:
                assert f"`{param.default}`" in DOC, f"{name}: default {param.name}={param.default} not in the docs"


def test_every_shipped_prompt_set_is_documented():
    for name in prompts.list_sets():
        assert f"`{name}`" in DOC, f"docs/rewards.md does not list the prompt set {name}"


def test_user_reward_example_runs():
    import re

    import torch

    section = DOC[DOC.index("## Your own reward") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace: dict = {}
    try:
        exec(compile(code, "docs/rewards.md", "exec"), namespace)
        images = torch.zeros(2, 3, 4, 4)
        images[1, 0] = 1.0
        assert namespace["reward"](images, ["a", "b"]).tolist() == [0.0, 1.0]
        assert rewards.REWARDS.describe()["redness"] == "Mean of one colour channel (needs: nothing)."
    finally:
        if "redness" in rewards.REWARDS:
            rewards.REWARDS.unregister("redness")
