import math

import pytest
import yaml

from flowrl.config import ConfigError, apply_overrides, save_config, to_dict
from flowrl.trainers import load_config
from flowrl.trainers.image.flow_grpo import FlowGRPOConfig
from flowrl.trainers.image.grpo_guard import GRPOGuardConfig


def test_yaml_overrides_only_the_given_values(tmp_path):
    path = tmp_path / "c.yaml"
    data = {"trainer": "grpo_guard", "sampling": {"num_steps": 6}, "objective": {"clip_eps_low": 1e-3}}
    path.write_text(yaml.safe_dump(data))
    config = load_config(path, ["run.epochs=3", "optim.betas=[0.8, 0.9]", "sampling.sde_window=[1, 4]"])
    assert isinstance(config, GRPOGuardConfig)
    assert config.sampling.num_steps == 6 and config.objective.clip_eps_low == 1e-3 and config.run.epochs == 3
    assert config.optim.betas == (0.8, 0.9) and config.sampling.sde_window == (1, 4)
    # untouched values keep GRPO-Guard's defaults
    assert config.advantage.std == "group" and config.steps.weighting == "inv_dt"
    assert config.objective.name == "grpo_guard"


def test_resolved_config_round_trips(tmp_path):
    config = load_config({"trainer": "flow_grpo", "rewards": [{"name": "digits_alignment", "weight": 2.0}]})
    save_config(config, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert to_dict(again) == to_dict(config) and again.rewards[0].weight == 2.0


def test_unknown_keys_name_the_key_and_close_matches():
    message = r"unknown config key 'sampling.num_step' in section 'sampling'.*Did you mean 'num_steps'"
    with pytest.raises(ConfigError, match=message):
        load_config({"trainer": "flow_grpo", "sampling": {"num_step": 4}})
    message = r"unknown config key 'clip_range' at the top level.*Valid choices: trainer, run, optim, batch"
    with pytest.raises(ConfigError, match=message):
        load_config({"trainer": "flow_grpo", "clip_range": 1e-4})
    with pytest.raises(ConfigError, match="unknown config key 'rewards\\[0\\].wieght'.*Did you mean 'weight'"):
        load_config({"trainer": "flow_grpo", "rewards": [{"name": "x", "wieght": 1}]})


def test_invalid_values_name_the_key_and_choices():
    with pytest.raises(ConfigError, match=r"invalid value 'batch' for advantage.std; choose from 'group', 'global'"):
        load_config({"trainer": "flow_grpo", "advantage": {"std": "batch"}})
    with pytest.raises(ConfigError, match="sampling.num_steps must be an integer, got 'ten'"):
        load_config({"trainer": "flow_grpo"}, ["sampling.num_steps=ten"])
    with pytest.raises(ConfigError, match="run.cpu must be true or false"):
        load_config({"trainer": "flow_grpo", "run": {"cpu": "yes"}})
    with pytest.raises(ConfigError, match="unknown objective 'ppo2'"):
        load_config({"trainer": "flow_grpo", "objective": {"name": "ppo2"}})
    with pytest.raises(ConfigError, match="unknown step weighting 'snr'"):
        load_config({"trainer": "flow_grpo", "steps": {"weighting": "snr"}})
    with pytest.raises(ConfigError, match="run.epochs must be >= 1"):
        load_config({"trainer": "flow_grpo", "run": {"epochs": 0}})
    with pytest.raises(ConfigError, match="grpo_guard trains the grpo_guard objective"):
        load_config({"trainer": "grpo_guard", "objective": {"name": "ppo"}})
    with pytest.raises(ConfigError, match="objective 'sapo' has no clip_eps_low; its hyper-parameters are tau_pos"):
        load_config({"trainer": "flow_grpo", "objective": {"name": "sapo", "clip_eps_low": 0.1}})
    with pytest.raises(ConfigError, match="unknown hyper-parameter 'tau' for objective 'sapo'.*tau_pos"):
        load_config({"trainer": "flow_grpo", "objective": {"name": "sapo", "kwargs": {"tau": 0.1}}})
    with pytest.raises(ConfigError, match="unknown aggregation 'mean'"):
        load_config({"trainer": "flow_grpo", "objective": {"agg": "mean"}})


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
    config = load_config({"trainer": "flow_grpo", "objective": {"clip_eps_low": "1e-4"}}, ["optim.lr=3e-5"])
    assert config.optim.lr == 3e-5 and config.objective.clip_eps_low == 1e-4
    # ... and `no` as false; a choice spelled `no` accepts it
    assert load_config({"trainer": "flow_grpo"}, ["run.mixed_precision=no"]).run.mixed_precision == "no"
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        apply_overrides({}, ["novalue"])
    with pytest.raises(ConfigError, match="'a' is not a section"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_shipped_configs_load():
    from pathlib import Path

    from flowrl import ablate
    from flowrl.sections import BaseConfig as TrainerConfig

    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "configs").rglob("*.yaml")):
        if path.parent.name == "accelerate":  # launcher configs (tests/test_distributed.py)
            continue
        if ablate.is_study(path):  # a study file: every cell of its grid must load
            study = ablate.load_study(path)
            configs = [
                {**c, "config": str(root / c["config"])} if isinstance(c, dict) else str(root / c)
                for c in study["configs"]
            ]
            for _, config_path, extra in ablate.variants(configs, study["grid"]):
                assert isinstance(load_config(config_path, [*study["overrides"], *extra]), TrainerConfig), path
            continue
        config = load_config(path)
        assert isinstance(config, TrainerConfig), path


def test_partial_sections_keep_the_trainers_own_defaults():
    # GRPO-Guard changes the default step weighting to inv_dt; a YAML that sets only another step field
    # must keep it, and unrelated keys of a nested section must keep their defaults too
    config = load_config({"trainer": "grpo_guard", "steps": {"fraction": 0.5}, "sampling": {"num_steps": 4}})
    assert config.steps.weighting == "inv_dt" and config.steps.fraction == 0.5
    assert config.sampling.noise_level == 0.7 and config.sampling.num_steps == 4
    assert isinstance(load_config({"trainer": "flow_grpo"}), FlowGRPOConfig)


@pytest.mark.parametrize(
    "old, new",
    [
        ({"clip_eps_low": 1e-3}, "objective.clip_eps_low"),
        ({"kl_beta": 0.04}, "kl.beta"),
        ({"kl_form": "flow_grpo"}, "kl.form"),
        ({"adv_std": "group"}, "advantage.std"),
        ({"tracker_buffer": 8}, "advantage.buffer_size"),
        ({"objective_kwargs": {"dual_clip_c": 3}}, "objective.kwargs"),
        ({"sampling": {"train_batch_size": 4}}, "batch.micro_batch_size"),
        ({"optim": {"gradient_accumulation": 2}}, "batch.mini_batch_size"),
        ({"optim": {"backward": "per_step"}}, "batch.backward"),
        ({"inner_epochs": 2}, "batch.inner_epochs"),
        ({"run": {"images_every": 2}}, "run.samples_every"),
        ({"model": {"max_sequence_length": 77}}, "model.options.max_sequence_length"),
        ({"target_kl": 0.01}, "objective.target_kl"),
    ],
)
def test_keys_of_earlier_versions_name_their_new_place(old, new):
    with pytest.raises(ConfigError, match=rf"was renamed: use {new}"):
        load_config({"trainer": "flow_grpo", **old})
    with pytest.raises(ConfigError, match="objective is a section: write objective.name: gspo"):
        load_config({"trainer": "flow_grpo", "objective": "gspo"})


def test_a_chosen_objective_keeps_its_own_defaults():
    # Flow-GRPO's clip range belongs to its default objective (ppo); switching the objective brings the new
    # objective's own preset bounds (GSPO: 3e-4 / 4e-4), unless the user sets them
    gspo = load_config({"trainer": "flow_grpo", "objective": {"name": "gspo"}})
    assert (gspo.objective.clip_eps_low, gspo.objective.clip_eps_high) == (None, None)
    assert gspo.objective.hparams() == {}
    ppo = load_config({"trainer": "flow_grpo", "objective": {"kwargs": {"dual_clip_c": 3.0}}})
    assert ppo.objective.hparams() == {"clip_eps_low": 1e-4, "dual_clip_c": 3.0}
    set_by_user = load_config({"trainer": "flow_grpo", "objective": {"name": "gspo", "clip_eps_low": 1e-3}})
    assert set_by_user.objective.hparams() == {"clip_eps_low": 1e-3}
    # the same for the advantage estimator: Flow-GRPO's global std and clip do not leak into leave-one-out
    loo = load_config({"trainer": "flow_grpo", "advantage": {"estimator": "leave_one_out"}})
    assert (loo.advantage.std, loo.advantage.clip) == ("group", None)


def test_load_config_needs_no_import_cycle():
    import subprocess
    import sys

    code = (
        "import flowrl.config, flowrl.sections, sys; assert 'flowrl.trainers' not in sys.modules, sorted(sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_learning_rate_schedules_by_hand():
    from flowrl.sections import OptimConfig

    cosine = OptimConfig(lr=1e-3, schedule="cosine", final_lr_ratio=0.1)
    # epoch e of 5: progress e / 4; lr = 1e-3 (0.1 + 0.9 (1 + cos(pi p)) / 2)
    expected = [1e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi * e / 4)) / 2) for e in range(5)]
    assert [cosine.lr_at(e, 5) for e in range(5)] == pytest.approx(expected)
    assert cosine.lr_at(0, 5) == pytest.approx(1e-3) and cosine.lr_at(4, 5) == pytest.approx(1e-4)
    linear = OptimConfig(lr=1e-3, schedule="linear", final_lr_ratio=0.0)
    assert [linear.lr_at(e, 3) for e in range(3)] == pytest.approx([1e-3, 5e-4, 0.0])
    assert OptimConfig(lr=1e-3).lr_at(7, 10) == 1e-3
    with pytest.raises(ConfigError, match="final_lr_ratio"):
        load_config({"trainer": "flow_grpo", "optim": {"final_lr_ratio": 2.0}})


@pytest.mark.parametrize(
    ("trainer", "key"),
    [
        *[("bc", key) for key in ("objective", "critic", "advantage", "vf_coef", "clip_vf", "ent_coef")],
        ("fpo", "ent_coef"),
        ("dppo", "ent_coef"),
        ("dpok", "drop_zero_std_groups"),
    ],
)
def test_a_config_has_no_key_its_trainer_would_refuse(trainer, key):
    """Configs hold only what applies (#46): the key is no field of the class, and setting it fails naming why."""
    import dataclasses

    from flowrl.trainers import TRAINERS

    config_class = TRAINERS.get(trainer).config_class
    assert key not in {f.name for f in dataclasses.fields(config_class)}
    data = {"trainer": trainer, key: {} if key in ("critic", "objective") else 1}
    with pytest.raises(ConfigError, match=rf"config key '{key}' does not apply to trainer '{trainer}': \w"):
        load_config(data)


def test_the_run_asks_a_config_its_capabilities_by_type():
    """No module reads a config's key by probing for it (`getattr(config, "kl", None)`): the mixins (`HasObjective`,
    `HasKL`, `HasSteps`, `HasGroupFilter`, `HasESSScaling`, `PromptedConfig`) say what a config has."""
    import dataclasses
    import re
    from pathlib import Path

    from flowrl.trainers import TRAINERS

    sections = {f.name for name in TRAINERS.names() for f in dataclasses.fields(TRAINERS.get(name).config_class)}
    root = Path(__file__).resolve().parents[1] / "flowrl"
    probe = re.compile(r"(?:getattr|hasattr)\((?:self\.)?(?:config|cfg), \"(\w+)\"")
    found = []
    for path in sorted(root.rglob("*.py")):
        found += [f"{path.relative_to(root)}: {name}" for name in probe.findall(path.read_text()) if name in sections]
    assert "drop_zero_std_groups" in sections and "kl" in sections  # (the check can fail)
    assert not found, f"config sections probed by name: {found}"
