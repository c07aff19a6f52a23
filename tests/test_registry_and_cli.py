import subprocess
import sys

import pytest

from flowrl import rewards
from flowrl.cli import main
from flowrl.core import list_objectives
from flowrl.registry import Registry


def test_registry_semantics():
    reg = Registry("widget")

    @reg.register("alpha")
    def alpha():
        """An alpha widget.

        More text."""

    reg.register("beta", object(), description="a beta")
    assert reg.names() == ["alpha", "beta"] and "alpha" in reg and len(reg) == 2
    assert reg.describe() == {"alpha": "An alpha widget.", "beta": "a beta"}
    with pytest.raises(ValueError, match="already registered"):
        reg.register("alpha", object())
    with pytest.raises(ValueError, match="unknown widget 'alpah'. Did you mean 'alpha'.*Valid choices: alpha, beta"):
        reg.get("alpah")
    reg.unregister("beta")
    assert reg.names() == ["alpha"]


def test_rewards_registry_api():
    @rewards.register("constant_test_reward")
    def constant(value=1.0):
        """A constant reward (test)."""
        return lambda images, prompts, **_: [value] * len(prompts)

    try:
        assert "constant_test_reward" in rewards.list_rewards()
        assert rewards.get("constant_test_reward", value=2.0)(None, ["a", "b"]) == [2.0, 2.0]
    finally:
        rewards.REWARDS.unregister("constant_test_reward")
    with pytest.raises(ValueError, match="unknown reward"):
        rewards.get("nope")


def test_flowrl_list_prints_every_section(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for section in [
        "objectives:",
        "advantage estimators:",
        "KL estimators:",
        "step selections:",
        "step weightings:",
        "samplers:",
    ]:
        assert section in out
    for name in list_objectives():
        assert f"  {name} " in out
    assert main(["list", "objectives"]) == 0
    out = capsys.readouterr().out
    assert "grpo_guard" in out and "advantage estimators" not in out
    assert main(["list", "nonsense"]) == 2


def _listed(section: str, capsys) -> dict[str, str]:
    assert main(["list", section]) == 0
    return {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:] if line.strip()}


def test_flowrl_list_models_names_each_family_s_pipeline_models_and_trainers(capsys):
    from flowrl.models.families import MODEL_FAMILIES

    image = {name for name, line in _listed("trainers", capsys).items() if line.endswith("Modality: image.")}
    assert {"flow_grpo", "awm", "dpok", "acflow"} <= image and not {"ppo", "fpo", "bc", "text"} & image
    lines = _listed("models", capsys)
    assert set(lines) == set(MODEL_FAMILIES.names())
    for name in MODEL_FAMILIES.names():
        cls = MODEL_FAMILIES.get(name)
        assert f"Pipeline: {cls.pipeline_class}." in lines[name] and cls.real_models, name
        listed = lines[name].split("Trainers: ")[1].rstrip(".")
        if listed.startswith("every image trainer"):  # by exception: every image trainer but the ones named
            trainers = image - set(listed.removeprefix("every image trainer").removeprefix(" but ").split(", "))
        else:
            trainers = set(listed.split(", "))
        assert "grpo_guard" in trainers and ("awm" in trainers) == (cls.time_kind == "flow"), name
        assert ("acflow" in trainers) == (cls.time_kind == "flow" and not cls.video), name


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "flowrl", "list", "objectives"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ppo" in out.stdout


def test_every_subcommand_the_parser_declares_has_a_function_and_no_other():
    """`flowrl.cli_parser` declares the subcommands, `flowrl.cli.COMMANDS` runs them: the two name the same ones."""
    import argparse

    from flowrl.cli import COMMANDS
    from flowrl.cli_parser import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(subparsers.choices) == sorted(COMMANDS)
    assert {"list", "train", "plan", "serve-reward", "score"} <= set(COMMANDS)
