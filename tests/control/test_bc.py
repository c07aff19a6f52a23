"""Behaviour cloning and fine-tuning a pre-trained flow policy: demonstrations recorded from a run, `trainer: bc`
learning an expert's actions, `init_from` starting `fpo` / `dppo` from the clone, the critic warm-up, errors."""

import json

import numpy as np
import pytest
import torch


gym = pytest.importorskip("gymnasium")  # the `rl` extra (CI installs it)

from flowrl.cli import main  # noqa: E402
from flowrl.control.demos import Demonstrations, load_demonstrations, record  # noqa: E402
from flowrl.control.envs import Normalizer  # noqa: E402
from flowrl.trainers import build_trainer  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402


def expert_action(obs: torch.Tensor) -> torch.Tensor:
    """A deterministic Pendulum "expert": torque against the angular velocity, `[N, 1]` in the box [-2, 2]."""
    return (-0.25 * obs[:, 2:3]).clamp(-2, 2)


def write_demos(path, n: int = 512, seed: int = 0):
    """`n` Pendulum observations (cos, sin, angular velocity) with `expert_action`'s actions, as a .npz file."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(n, generator=g) * 2 * torch.pi
    obs = torch.stack([angle.cos(), angle.sin(), torch.randn(n, generator=g) * 3], 1)
    return Demonstrations(obs, expert_action(obs), np.zeros(1), "Pendulum-v1").save(path)


def bc_config(tmp_path, demos, **extra):
    overrides = [f"demonstrations={demos}", *(f"{k}={json.dumps(v)}" for k, v in extra.items())]
    return tiny_config("bc", tmp_path, overrides=overrides)


def test_bc_learns_the_expert_s_actions(tmp_path):
    """The flow-matching loss falls and the deterministic action (integration from zero noise) approaches the
    expert's on held-out observations."""
    demos = write_demos(tmp_path / "demos.npz")
    config = bc_config(
        tmp_path / "run",
        demos,
        **{"run.epochs": 40, "batch.mini_batch_size": 128, "batch.micro_batch_size": 128, "optim.lr": 3e-3},
    )
    trainer = build_trainer(config)
    held_out = load_demonstrations(write_demos(tmp_path / "held.npz", n=256, seed=1))

    def error():
        with torch.no_grad():
            act = trainer.policy.actor.act(held_out.obs, deterministic=True)
        return float((act - held_out.actions).square().mean())

    before = error()
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["bc_loss"] for r in rows if "bc_loss" in r]
    assert rows[-1]["demo_transitions"] == 40 * 512 and "env_steps" not in rows[-1]
    assert losses[-1] < 0.5 * losses[0]
    assert error() < 0.2 * before


def test_init_from_starts_fine_tuning_from_the_clone_and_the_critic_warms_up_alone(tmp_path):
    demos = write_demos(tmp_path / "demos.npz")
    build_trainer(bc_config(tmp_path / "bc", demos, **{"run.epochs": 3, "run.save_every": 3})).train()
    from flowrl.trainers import load_run

    cloned = load_run(tmp_path / "bc").algorithm.policy.actor.state_dict()
    for trainer_name in ("fpo", "dppo"):
        config = tiny_config(
            trainer_name, tmp_path / trainer_name, overrides=[f"init_from={tmp_path / 'bc'}", "critic.warmup_epochs=1"]
        )
        trainer = build_trainer(config)
        actor = trainer.policy.actor
        assert all(torch.equal(v, cloned[k]) for k, v in actor.state_dict().items())
        critic = {k: v.clone() for k, v in trainer.policy.critic.state_dict().items()}
        trainer.train_epoch(0)  # warm-up: the policy loss carries no gradient
        assert all(torch.equal(v, cloned[k]) for k, v in actor.state_dict().items()), trainer_name
        assert any(not torch.equal(v, critic[k]) for k, v in trainer.policy.critic.state_dict().items())
        trainer.train_epoch(1)
        assert any(not torch.equal(v, cloned[k]) for k, v in actor.state_dict().items()), trainer_name


def test_demos_cli_records_a_run_and_bad_inputs_fail_in_one_line(tmp_path, capsys):
    run = tmp_path / "ppo"
    build_trainer(tiny_config("ppo", run, overrides=["run.epochs=1", "run.save_every=1"])).train()
    out = tmp_path / "demos.npz"
    assert main(["demos", str(run), "--episodes", "2", "--noise", "0.5", "--out", str(out)]) == 0
    demos = load_demonstrations(out, 3, 1)
    assert len(demos) == 400 and demos.env_id == "Pendulum-v1" and len(demos.episode_returns) == 2
    assert demos.actions.abs().max() <= 2.0  # executed actions: clipped to the box
    assert "400 transitions of 2 Pendulum-v1 episodes" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="flowrl demos RUN"):
        load_demonstrations(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="actions have 1 dimensions, the environment 6"):
        load_demonstrations(out, 3, 6)
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="is not a demonstrations file"):
        load_demonstrations(tmp_path / "text.npz")
    assert (
        main(
            [
                "train",
                "configs/control/pendulum_bc.yaml",
                "--set",
                f"demonstrations={tmp_path / 'missing.npz'}",
                "--output-dir",
                str(tmp_path / "bc"),
            ]
        )
        != 0
    )
    assert capsys.readouterr().err.strip().endswith("(write one with `flowrl demos RUN`)")
    # a Gaussian PPO run cannot start a flow policy
    assert (
        main(
            [
                "train",
                "configs/control/pendulum_fpo.yaml",
                "--set",
                f"init_from={run}",
                "--output-dir",
                str(tmp_path / "ft"),
            ]
        )
        != 0
    )
    assert "is not this run's network (FlowPolicy)" in capsys.readouterr().err


def test_record_keeps_whole_episodes_with_noise():
    class Zero(torch.nn.Module):
        def act(self, obs, generator=None, deterministic=False):
            return torch.zeros(len(obs), 1)

    raw = Normalizer(3, 2, obs=False, reward=False, gamma=0.99)
    plain = record(Zero(), raw, "Pendulum-v1", episodes=2, seed=3)
    noisy = record(Zero(), raw, "Pendulum-v1", episodes=2, noise=1.0, seed=3)
    assert len(plain) == len(noisy) == 400 and torch.equal(plain.obs[:2], noisy.obs[:2])  # same seeds
    assert plain.actions.abs().max() == 0 and noisy.actions.std() > 0.5


def test_the_two_route_task_punishes_the_mean_route_and_its_expert_takes_both():
    from flowrl.control.obstacle import expert_action, obstacle_metrics, scripted_demonstrations

    straight = obstacle_metrics(lambda obs, g: torch.tensor([[1.0, 0.0]]).expand(len(obs), 2), episodes=50)
    assert straight == {"success": 0.0, "collided": 1.0, "above": 0.0}  # the average of the two routes

    def expert(obs, g):  # one route per row, alternating
        route = np.where(np.arange(len(obs)) % 2 == 0, 1.0, -1.0)
        return torch.as_tensor(expert_action(obs.numpy().astype(np.float64), route), dtype=torch.float32)

    both = obstacle_metrics(expert, episodes=50)
    assert both["success"] == 1.0 and both["collided"] == 0.0 and both["above"] == 0.5
    demos = scripted_demonstrations(40, seed=0, noise=0.0)
    assert demos.episode_returns.mean() == 1.0 and demos.env_id == "flowrl/ObstaclePointMass-v0"
    near_start = demos.obs[:, 0] < -0.3  # the routes split 2 steps before the disc: bimodal actions there
    split = demos.actions[near_start & (demos.obs[:, 0] > -0.55)]
    assert (split[:, 1] > 0.3).any() and (split[:, 1] < -0.3).any()


def test_bc_of_a_gaussian_fits_by_maximum_likelihood(tmp_path):
    demos = write_demos(tmp_path / "demos.npz")
    config = bc_config(tmp_path / "run", demos, **{"actor": "gaussian", "run.epochs": 30, "optim.lr": 3e-3})
    trainer = build_trainer(config)
    assert type(trainer.policy.actor).__name__ == "GaussianPolicy"
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["bc_loss"] for r in rows if "bc_loss" in r]
    assert losses[-1] < losses[0] - 0.5  # the negative log-likelihood per action dimension falls
    held = load_demonstrations(write_demos(tmp_path / "held.npz", n=256, seed=1))
    with torch.no_grad():
        mean = trainer.policy.actor.act(held.obs, deterministic=True)
    assert float((mean - held.actions).square().mean()) < 0.05
