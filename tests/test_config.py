import pytest
import yaml

from flowrl.config import ConfigError, apply_overrides, load_config, save_config, to_dict
from flowrl.trainers import FlowGRPOConfig, GRPOGuardConfig


def test_yaml_overrides_only_the_given_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"trainer": "grpo_guard", "sampling": {"num_steps": 6}, "clip_eps_low": 1e-3}))
    config = load_config(path, ["run.epochs=3", "optim.betas=[0.8, 0.9]", "sampling.sde_window=[1, 4]"])
    assert isinstance(config, GRPOGuardConfig)
    assert config.sampling.num_steps == 6 and config.clip_eps_low == 1e-3 and config.run.epochs == 3
    assert config.optim.betas == (0.8, 0.9) and config.sampling.sde_window == (1, 4)
    # untouched values keep GRPO-Guard's defaults
    assert config.adv_std == "group" and config.steps.weighting == "inv_dt" and config.objective == "grpo_guard"


def test_resolved_config_round_trips(tmp_path):
    config = load_config({"trainer": "flow_grpo", "rewards": [{"name": "digits_alignment", "weight": 2.0}]})
    save_config(config, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert to_dict(again) == to_dict(config) and again.rewards[0].weight == 2.0


def test_unknown_keys_name_the_key_and_close_matches():
    message = r"unknown config key 'sampling.num_step' in section 'sampling'.*Did you mean 'num_steps'"
    with pytest.raises(ConfigError, match=message):
        load_config({"trainer": "flow_grpo", "sampling": {"num_step": 4}})
    message = r"unknown config key 'clip_range' at the top level.*Valid choices: trainer, model"
    with pytest.raises(ConfigError, match=message):
        load_config({"trainer": "flow_grpo", "clip_range": 1e-4})
    with pytest.raises(ConfigError, match="unknown config key 'rewards\\[0\\].wieght'.*Did you mean 'weight'"):
        load_config({"trainer": "flow_grpo", "rewards": [{"name": "x", "wieght": 1}]})


def test_invalid_values_name_the_key_and_choices():
    with pytest.raises(ConfigError, match=r"invalid value 'batch' for adv_std; choose from 'group', 'global', 'none'"):
        load_config({"trainer": "flow_grpo", "adv_std": "batch"})
    with pytest.raises(ConfigError, match="sampling.num_steps must be an integer, got 'ten'"):
        load_config({"trainer": "flow_grpo"}, ["sampling.num_steps=ten"])
    with pytest.raises(ConfigError, match="run.cpu must be true or false"):
        load_config({"trainer": "flow_grpo", "run": {"cpu": "yes"}})
    with pytest.raises(ConfigError, match="unknown objective 'ppo2'"):
        load_config({"trainer": "flow_grpo", "objective": "ppo2"})
    with pytest.raises(ConfigError, match="unknown step weighting 'snr'"):
        load_config({"trainer": "flow_grpo", "steps": {"weighting": "snr"}})
    with pytest.raises(ConfigError, match="run.epochs must be >= 1"):
        load_config({"trainer": "flow_grpo", "run": {"epochs": 0}})
    with pytest.raises(ConfigError, match="grpo_guard trains the grpo_guard objective"):
        load_config({"trainer": "grpo_guard", "objective": "ppo"})


def test_trainer_key_is_required_and_checked(tmp_path):
    with pytest.raises(ConfigError, match="must name its trainer"):
        load_config({"sampling": {}})
    with pytest.raises(ConfigError, match="unknown trainer 'flowgrpo'.*Did you mean 'flow_grpo'"):
        load_config({"trainer": "flowgrpo"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "bad.yaml")


def test_override_syntax():
    assert apply_overrides({"a": {"b": 1}}, ["a.c=null", "d=[1, 2]"]) == {"a": {"b": 1, "c": None}, "d": [1, 2]}
    # YAML 1.1 reads 1e-4 as a string; number fields accept it
    assert load_config({"trainer": "flow_grpo", "clip_eps_low": "1e-4"}, ["optim.lr=3e-5"]).optim.lr == 3e-5
    # ... and `no` as false; a choice spelled `no` accepts it
    assert load_config({"trainer": "flow_grpo"}, ["run.mixed_precision=no"]).run.mixed_precision == "no"
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        apply_overrides({}, ["novalue"])
    with pytest.raises(ConfigError, match="'a' is not a section"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_shipped_configs_load():
    from pathlib import Path

    from flowrl.trainers import TrainerConfig

    for path in sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml")):
        config = load_config(path)
        assert isinstance(config, TrainerConfig), path


def test_partial_sections_keep_the_trainers_own_defaults():
    # GRPO-Guard changes the default step weighting to inv_dt; a YAML that sets only another step field
    # must keep it, and unrelated keys of a nested section must keep their defaults too
    config = load_config({"trainer": "grpo_guard", "steps": {"fraction": 0.5}, "sampling": {"num_steps": 4}})
    assert config.steps.weighting == "inv_dt" and config.steps.fraction == 0.5
    assert config.sampling.noise_level == 0.7 and config.sampling.num_steps == 4
    assert isinstance(load_config({"trainer": "flow_grpo"}), FlowGRPOConfig)
