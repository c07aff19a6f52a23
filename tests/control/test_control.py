"""Control trainers (`ppo`, `fpo`, `dppo`) on Gymnasium: exact ratios, A2C as PPO, learning, resume, errors."""

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch


gym = pytest.importorskip("gymnasium")  # the `rl` extra (CI installs it)

from flowrl.config import ConfigError  # noqa: E402
from flowrl.control.envs import BIMODAL_ID, Normalizer, RunningMeanStd, make_vec_env  # noqa: E402
from flowrl.core import compute_policy_loss  # noqa: E402
from flowrl.run.scheduler import UpdateBatch  # noqa: E402
from flowrl.trainers import build_trainer, load_config  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402


def tiny(trainer, env="Pendulum-v1", **extra):
    """The shared tiny control config (2 environments x 32 steps, mini-batches of 16, 2 inner epochs) on `env`,
    `extra` given as dotted keys."""
    overrides = [f"env.id={env}", *(f"{key}={json.dumps(value)}" for key, value in extra.items())]
    return tiny_config(trainer, overrides=overrides)


def prepared(trainer, epoch=0):
    """The epoch's update batch: the rollout with its behaviour log-probs, every process's advantages."""
    batch, _, _ = trainer.prepare_epoch(epoch)
    return batch


@pytest.mark.parametrize(
    "name,extra",
    [
        ("ppo", {}),
        ("fpo", {}),
        ("fpo", {"ratio": "per_draw"}),
        ("dppo", {}),
        ("fpo", {"t_sampling": "grid", "supervise": "eps"}),
    ],
)
def test_ratio_is_exactly_one_at_the_behaviour_weights(tmp_path, name, extra):
    trainer = build_trainer(tiny(name, **extra), output_dir=tmp_path)
    batch = prepared(trainer)
    rollout = batch.data
    k = trainer.algorithm.num_elements(rollout)
    assert rollout.log_probs.shape == (64, {"ppo": 1, "dppo": 10}.get(name, 8 if extra.get("ratio") else 1))
    index, _ = trainer.algorithm.elements(batch, 0)
    for rows in torch.randperm(len(rollout)).split(16):  # any minibatch of the training size re-scores exactly
        terms = trainer.algorithm.policy_terms(rollout.select(rows), index[rows])
        assert terms.logp.shape == (16, k)
        assert torch.equal(terms.logp, terms.old_logp)
        _, metrics = compute_policy_loss("ppo", terms.logp, terms.old_logp, torch.randn(16), clip_eps_low=0.2)
        assert metrics["clipfrac"] == 0 and metrics["ratio_mean"] == 1


def test_dppo_chain_ends_in_the_action_and_rescoring_changes_with_the_weights(tmp_path):
    trainer = build_trainer(tiny("dppo"), output_dir=tmp_path)
    batch = prepared(trainer)
    rollout = batch.data
    assert torch.equal(rollout.chain[:, -1], rollout.actions)
    assert rollout.chain.shape == (64, 11, 1)
    rows = torch.arange(16)
    index = trainer.algorithm.elements(batch, 0)[0][rows]
    with torch.no_grad():
        for p in trainer.policy.actor.parameters():
            p.add_(0.01)
    terms = trainer.algorithm.policy_terms(rollout.select(rows), index)
    assert not torch.equal(terms.logp, terms.old_logp)
    # the step log-prob is the kernel's Gaussian, mean over the action dimension: re-derive step 3 by hand
    actor, k = trainer.policy.actor, 3
    x, x_next = rollout.chain[rows, k], rollout.chain[rows, k + 1]
    s, s_next = actor.taus[k], actor.taus[k + 1]
    v = actor.velocity(x, s.expand(16), rollout.obs[rows])
    dt, eta = s_next - s, actor.noise_level
    mean = x + dt * (v + eta**2 / (2 * s) * (x + (1 - s) * v))
    # DPPO's guards (its code's defaults): std floored at 0.1 (the kernel's is 0.3 sqrt(0.1) = 0.095), each
    # element's log-density clamped to [-5, 2], then the mean over action dimensions
    std = (eta * (-dt).sqrt()).clamp_min(0.1)
    per_element = -(x_next - mean).square() / (2 * std**2) - std.log() - 0.5 * np.log(2 * np.pi)
    torch.testing.assert_close(terms.logp[:, k], per_element.clamp(-5, 2).mean(-1), rtol=1e-5, atol=1e-5)


def test_dppo_guards_by_hand():
    from flowrl.control.policies import DPPOGuards

    guards = DPPOGuards(min_std=0.1, noise_clip=3.0, log_prob_clamp=(-5.0, 2.0))
    mean, std = torch.zeros(1, 3), torch.tensor([0.05])  # a step std below the floor
    x = guards.sample(mean, std, torch.tensor([[5.0, -5.0, 0.5]]))
    assert x[0].tolist() == pytest.approx([0.3, -0.3, 0.05])  # 0.1 * clip(z, +-3)
    # per element -z^2/2 - log(0.1) - log(2 pi)/2: z = 5 -> -11.1, clamped to -5; z = 3 -> -3.116; z = 0 -> 1.384
    c = 2.302585 - 0.5 * np.log(2 * np.pi)
    value = guards.log_prob(torch.tensor([[0.5, 0.3, 0.0]]), mean, std).item()
    assert value == pytest.approx(np.mean([-5.0, -4.5 + c, c]), rel=1e-5)
    # the upper clamp binds only below std 0.054: unfloored std 0.01 at z = 0 gives 3.686, clamped to 2
    sharp = DPPOGuards(log_prob_clamp=(-5.0, 2.0))
    assert sharp.log_prob(torch.zeros(1, 3), mean, torch.tensor([0.01])).item() == pytest.approx(2.0)


def test_dppo_without_guards_scores_with_the_flow_kernels_own_gaussian(tmp_path):
    config = tiny("dppo", **{"policy.min_std": None, "policy.noise_clip": None, "policy.log_prob_clamp": None})
    trainer = build_trainer(config, output_dir=tmp_path)
    rollout = prepared(trainer).data
    actor, k, rows = trainer.policy.actor, 3, torch.arange(16)
    x, x_next = rollout.chain[rows, k], rollout.chain[rows, k + 1]
    s, s_next = actor.taus[k], actor.taus[k + 1]
    v = actor.velocity(x, s.expand(16), rollout.obs[rows])
    dt, eta = s_next - s, actor.noise_level
    mean = x + dt * (v + eta**2 / (2 * s) * (x + (1 - s) * v))
    std = eta * (-dt).sqrt()
    expected = (-(x_next - mean).square() / (2 * std**2) - std.log() - 0.5 * np.log(2 * np.pi)).mean(-1)
    terms = trainer.algorithm.policy_terms(rollout.select(rows), torch.full((16, 1), k))
    torch.testing.assert_close(terms.logp[:, 0], expected, rtol=1e-5, atol=1e-5)


def test_fpo_gradient_at_the_old_weights_is_advantage_weighted_flow_matching(tmp_path):
    trainer = build_trainer(tiny("fpo"), output_dir=tmp_path)
    update = prepared(trainer)
    rollout = update.data
    rows = torch.arange(16)
    batch, adv = rollout.select(rows), torch.randn(16)
    index = trainer.algorithm.elements(update, 0)[0][rows]
    params = list(trainer.policy.actor.parameters())
    terms = trainer.algorithm.policy_terms(batch, index)
    loss, _ = compute_policy_loss("ppo", terms.logp, terms.old_logp, adv, clip_eps_low=0.05)
    grads = torch.autograd.grad(loss, params)
    # d/dtheta of -mean_b A_b r_b at r = 1 is mean_b A_b d mean_i l_theta_i
    losses = trainer.algorithm.losses(batch.obs, batch.actions, batch.draws).mean(-1)
    expected = torch.autograd.grad((adv * losses).mean(), params)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_fpo_playground_draws_take_flow_times_on_the_sampler_grid(tmp_path):
    # FPO's playground (`discretize_t_for_training`): t uniform over the Euler steps' start times 1, 0.9, ..., 0.1
    trainer = build_trainer(tiny("fpo", t_sampling="grid", num_draws=64), output_dir=tmp_path)
    taus = prepared(trainer).data.draws.taus
    grid = {round(1 - k / 10, 6) for k in range(10)}
    assert {round(t, 6) for t in taus.flatten().tolist()} == grid  # every start time drawn, nothing else


def test_a2c_is_a_special_case_of_ppo(tmp_path):
    """Huang et al. 2022 (arXiv:2205.09123): one epoch, one minibatch of the whole rollout, lambda 1, no
    advantage whitening, RMSprop: flowrl's PPO update is SB3's A2C update."""
    config = tiny(
        "ppo",
        vf_coef=0.5,
        **{
            "batch.inner_epochs": 1,
            "batch.mini_batch_size": None,
            "advantage.lam": 1.0,
            "advantage.normalize": False,
            "optim.optimizer": "rmsprop",
            "optim.lr": 7e-4,
            "optim.eps": 1e-5,
            "optim.max_grad_norm": 0.5,
        },
    )
    trainer = build_trainer(config, output_dir=tmp_path)
    batch = prepared(trainer)
    rollout = batch.data
    reference = copy.deepcopy(trainer.policy)
    initial = copy.deepcopy(trainer.policy)
    trainer.scheduler.run(batch, 0)  # one mini-batch of the whole rollout, in micro-batches of 16

    # SB3's A2C.train: one step on the whole rollout
    optimizer = torch.optim.RMSprop(reference.parameters(), lr=7e-4, alpha=0.99, eps=1e-5, weight_decay=0)
    log_prob = reference.actor.log_prob(rollout.obs, rollout.actions)
    policy_loss = -(rollout.advantages * log_prob).mean()
    value_loss = torch.nn.functional.mse_loss(rollout.returns, reference.value(rollout.obs))
    (policy_loss + 0.5 * value_loss).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    optimizer.step()
    for (name, p), q, p0 in zip(trainer.policy.named_parameters(), reference.parameters(), initial.parameters()):
        assert not torch.equal(p, p0), name  # the update moved every parameter ...
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)  # ... exactly as A2C does


def test_ppo_update_matches_stable_baselines3_on_its_own_rollout(tmp_path, monkeypatch):
    """SB3 collects a rollout (VecNormalize, time-limit bootstraps); flowrl's GAE on it equals SB3's, and flowrl's
    update from the same weights, over SB3's minibatch order, ends at SB3's weights (Adam, clip, whitening, MSE
    value loss, gradient clip: field for field)."""
    sb3 = pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.env_util import make_vec_env as sb3_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from flowrl.control.rollout import ControlRollout
    from flowrl.core import gae

    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3"))  # else SB3 leaves an empty log folder in /tmp per run
    T, E = 128, 2  # Pendulum's 200-step limit falls inside: one truncation per environment is bootstrapped
    venv = VecNormalize(sb3_vec_env("Pendulum-v1", n_envs=E, seed=3), gamma=0.99)
    model = sb3.PPO("MlpPolicy", venv, n_steps=T, batch_size=64, n_epochs=2, seed=3, device="cpu")
    model.learn(3 * T * E)  # the statistics and weights move first; the next rollout crosses step 400
    _, callback = model._setup_learn(T * E, None, reset_num_timesteps=False)
    callback.on_training_start(locals(), globals())
    model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=T)
    buf, sb = model.rollout_buffer, model.policy
    assert buf.episode_starts.sum() >= E

    trainer = build_trainer(
        tiny("ppo", **{"batch.mini_batch_size": 64, "batch.micro_batch_size": 64}), output_dir=tmp_path
    )
    actor, critic = trainer.policy.actor, trainer.policy.critic
    pi, vf = sb.mlp_extractor.policy_net, sb.mlp_extractor.value_net
    pairs = [
        (actor.mean[0], pi[0]),
        (actor.mean[2], pi[2]),
        (actor.mean[4], sb.action_net),
        (critic[0], vf[0]),
        (critic[2], vf[2]),
        (critic[4], sb.value_net),
    ]
    with torch.no_grad():
        for ours, theirs in pairs:
            ours.weight.copy_(theirs.weight)
            ours.bias.copy_(theirs.bias)
        actor.log_std.copy_(sb.log_std)

    def rows(x):  # SB3's [T, E, ...] -> flowrl's time-major rows t * E + e
        x = torch.as_tensor(np.asarray(x, np.float32))
        return x.reshape(T * E, *x.shape[2:])

    dones = torch.as_tensor(np.concatenate([buf.episode_starts[1:], model._last_episode_starts[None]])).T.bool()
    with torch.no_grad():
        last = trainer.policy.value(torch.as_tensor(model._last_obs, dtype=torch.float32))
    advantages, returns = gae(
        torch.as_tensor(buf.rewards).T, torch.as_tensor(buf.values).T, dones, last, gamma=0.99, lam=0.95
    )
    torch.testing.assert_close(advantages.T, torch.as_tensor(buf.advantages), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns.T, torch.as_tensor(buf.returns), rtol=1e-5, atol=1e-5)

    rollout = ControlRollout(
        obs=rows(buf.observations),
        actions=rows(buf.actions),
        values=rows(buf.values),
        advantages=rows(buf.advantages),
        returns=rows(buf.returns),
    )
    log_probs, _ = trainer.algorithm.behaviour(rollout, torch.arange(T * E), T * E)
    torch.testing.assert_close(log_probs[:, 0], rows(buf.log_probs), rtol=1e-5, atol=1e-5)
    rollout = dataclasses.replace(rollout, log_probs=log_probs)

    orders, permutation = [], np.random.permutation

    def recorded(n):
        order = permutation(n)
        orders.append(order.copy())
        return order

    initial = [theirs.weight.detach().clone() for _, theirs in pairs]
    sb.optimizer.state.clear()  # both updates start from fresh Adam moments
    monkeypatch.setattr(np.random, "permutation", recorded)
    model.train()
    monkeypatch.undo()
    assert len(orders) == 2
    replay = iter(orders)

    def sb3_order(n, generator=None):  # SB3's flat index e * T + t, as flowrl rows
        order = torch.as_tensor(next(replay))
        return (order % T) * E + order // T

    import flowrl.run.scheduler as scheduler

    batch = UpdateBatch(
        data=rollout,
        rows=torch.arange(T * E),
        size=T * E,
        advantages=rollout.advantages,
        trainable=torch.ones(T * E, dtype=torch.bool),
    )
    monkeypatch.setattr(scheduler.torch, "randperm", sb3_order)
    trainer.scheduler.run(batch, 0)
    monkeypatch.undo()
    for (ours, theirs), start in zip(pairs, initial):
        moved = (theirs.weight - start).abs().max()
        assert moved > 1e-3  # 8 Adam steps moved the weights ...
        assert (ours.weight - theirs.weight).abs().max() < 1e-4 * moved  # ... and flowrl's moved them the same
    torch.testing.assert_close(actor.log_std, sb.log_std, rtol=0, atol=1e-6)


@pytest.mark.long
def test_short_pendulum_run_beats_the_untrained_policy(tmp_path):
    config = load_config(
        "configs/control/pendulum_ppo.yaml", ["total_env_steps=40960", "eval.every=0", "run.log_with=[]"]
    )
    summary = build_trainer(config, output_dir=tmp_path).train()
    assert summary["reward_end"] > summary["reward_start"] + 300, summary["eval_history"]


def test_exact_resume(tmp_path):
    def config():
        return tiny("fpo", env=BIMODAL_ID, **{"run.epochs": 3, "run.save_every": 1})

    full = build_trainer(config(), output_dir=tmp_path / "full")
    full.train()
    part = build_trainer(config(), output_dir=tmp_path / "part")
    part.config.run.epochs = 2
    part.train()
    resumed = build_trainer(config(), output_dir=tmp_path / "part")
    resumed.train(resume=True)
    for p, q in zip(full.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(p, q)
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    drop = (
        "time",
        "wall_s",
        "env_steps_per_s",
        "threads",
        "memory/",
        "eval/",
    )  # the interrupted run evaluated at its end
    strip = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(drop)} for r in again]


def test_resume_restores_the_normalisation_statistics(tmp_path):
    def config():
        return tiny("ppo", **{"env.normalize_obs": True, "env.normalize_reward": True, "run.save_every": 1})

    first = build_trainer(config(), output_dir=tmp_path)
    first.train()
    second = build_trainer(config(), output_dir=tmp_path)
    second.load_checkpoint(tmp_path / "checkpoints" / "epoch_2")
    a, b = first.modality.normalizer, second.modality.normalizer
    np.testing.assert_array_equal(a.obs_rms.mean, b.obs_rms.mean)
    np.testing.assert_array_equal(a.ret_rms.var, b.ret_rms.var)
    assert a.obs_rms.count == b.obs_rms.count


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="reward from the environment"):
        load_config({"trainer": "ppo", "rewards": [{"name": "digits_alignment"}]})
    with pytest.raises(ValueError, match="'prompts' does not apply to trainer 'fpo'"):
        load_config({"trainer": "fpo", "prompts": {"group_size": 4}})
    with pytest.raises(ConfigError, match="'gae_lambda' was renamed: use advantage.lam"):
        load_config({"trainer": "ppo", "gae_lambda": 0.9})
    with pytest.raises(ConfigError, match="'minibatch_size' was renamed: use batch.mini_batch_size"):
        load_config({"trainer": "ppo", "minibatch_size": 32})
    with pytest.raises(ConfigError, match="env.num_envs"):
        load_config({"trainer": "dppo", "env": {"num_envs": "four"}})
    with pytest.raises(ConfigError, match="ratio"):
        load_config({"trainer": "fpo", "ratio": "median"})
    budget = {"trainer": "ppo", "total_env_steps": 10000, "env": {"num_envs": 2, "steps_per_env": 1000}}
    assert load_config(budget).run.epochs == 5


def test_unknown_environment_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown Gymnasium environment 'NoSuchEnv-v0'"):
        build_trainer(tiny("ppo", env="NoSuchEnv-v0"), output_dir=tmp_path)
    with pytest.raises(ValueError, match="Box"):
        build_trainer(tiny("ppo", env="CartPole-v1"), output_dir=tmp_path)


def test_bimodal_point_mass_dynamics_and_probes():
    env = gym.make(BIMODAL_ID, start=(0.0, 0.8))
    obs, _ = env.reset(seed=0)
    np.testing.assert_allclose(obs, [0.0, 0.8])
    obs, reward, terminated, truncated, info = env.step(np.array([0.0, 1.0]))
    assert reward == 1.0 and terminated and info["goal"] == 1
    env = gym.make(BIMODAL_ID, start=(0.0, 0.0))
    env.reset(seed=0)
    obs, reward, terminated, _, _ = env.step(np.array([5.0, -5.0]))  # actions are clipped to [-1, 1]
    np.testing.assert_allclose(obs, [0.1, -0.1], atol=1e-6)
    assert reward == 0.0 and not terminated

    from flowrl.control.bimodal import bimodal_metrics

    def up_or_down(obs, generator):  # a policy with both modes at the saddle
        sign = torch.where(torch.rand(obs.shape[0], generator=generator) < 0.5, -1.0, 1.0)
        return torch.stack([torch.zeros_like(sign), sign], 1)

    metrics = bimodal_metrics(lambda o, g: up_or_down(o, g), episodes=200)
    assert 0.4 < metrics["saddle_up"] < 0.6
    always_up = bimodal_metrics(lambda o, g: torch.tensor([[0.0, 1.0]]).expand(o.shape[0], 2))
    assert always_up == {"saddle_up": 1.0, "top_fraction": 1.0, "saddle_success": 1.0}


def test_running_statistics_and_reward_scaling():
    rms = RunningMeanStd((3,))
    data = np.random.default_rng(0).normal(2.0, 3.0, size=(500, 3))
    for part in np.split(data, 5):
        rms.update(part)
    np.testing.assert_allclose(rms.mean, data.mean(0), rtol=1e-4)
    np.testing.assert_allclose(rms.var, data.var(0), rtol=1e-3)
    norm = Normalizer(3, 2, obs=False, reward=True, gamma=0.5)
    np.testing.assert_array_equal(norm.observe(data[:2], update=True), data[:2].astype(np.float32))
    scaled = norm.reward(np.array([1.0, 2.0]), np.array([False, True]))
    assert np.all(np.abs(scaled) <= 10) and norm.returns[1] == 0.0 and norm.returns[0] == 1.0


def test_vector_env_bootstraps_time_limits_in_same_step_mode():
    envs = make_vec_env("Pendulum-v1", 2)
    envs.reset(seed=0)
    for _ in range(199):
        _, _, terminated, truncated, _ = envs.step(np.zeros((2, 1), np.float32))
        assert not truncated.any()
    obs, _, terminated, truncated, info = envs.step(np.zeros((2, 1), np.float32))
    assert truncated.all() and not terminated.any()
    assert info["final_obs"][0].shape == (3,) and not np.allclose(info["final_obs"][0], obs[0])


@pytest.mark.parametrize("path", sorted(Path("configs/control").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_control_config_trains_one_short_epoch(path, tmp_path):
    shipped = load_config(path)
    demos = []  # behaviour cloning: a small demonstrations file stands in for the expert's
    if shipped.trainer == "bc":
        from flowrl.control.obstacle import scripted_demonstrations
        from tests.control.test_bc import write_demos

        file = tmp_path / "demos.npz"
        written = scripted_demonstrations(4).save(file) if "Obstacle" in shipped.env.id else write_demos(file)
        demos = [f"demonstrations={written}"]
    config = load_config(
        path,
        [
            "env.steps_per_env=16",
            "total_env_steps=null",
            "run.epochs=1",
            "eval.episodes=1",
            "run.log_with=[]",
            "run.samples_every=0",
            *demos,
        ],
    )
    assert config.env == dataclasses.replace(shipped.env, steps_per_env=16)
    summary = build_trainer(config, output_dir=tmp_path).train()
    assert summary["epochs"] == 1 and np.isfinite(summary["reward_end"])


def test_control_cli_trains_the_bimodal_task(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "run"
    code = main(
        [
            "train",
            "configs/control/bimodal_fpo.yaml",
            "--output-dir",
            str(out),
            "--set",
            "total_env_steps=4096",
            "--set",
            "run.log_with=[]",
            "--set",
            "eval.every=1",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {"eval/saddle_up", "eval/top_fraction", "eval/reward"} <= set(summary["eval_end"])
    assert (out / "images" / "epoch_0001.png").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["env_steps"] == 4096 and "clipfrac" in rows[-1] and "env_steps_per_s" in rows[-1]
    assert main(["eval", str(out)]) == 0


@pytest.mark.parametrize("continue_episodes", [False, True])
def test_continue_episodes_carries_episodes_across_epochs(tmp_path, continue_episodes):
    """Pendulum's episodes last 200 steps, an epoch 32: only with `env.continue_episodes` does an epoch pick up
    where the last one stopped, and do whole episodes end (at step 200, inside epoch 6)."""
    trainer = build_trainer(tiny("ppo", **{"env.continue_episodes": continue_episodes}), output_dir=tmp_path)
    collector = trainer.collector
    epochs = [collector.collect(epoch) for epoch in range(7)]
    ended = [c.info["episode_lengths"] for c in epochs]
    assert ended == ([[]] * 6 + [[200, 200]] if continue_episodes else [[]] * 7)
    # epoch 1 starts from epoch 1's reset seeds only when episodes are not carried over
    fresh = build_trainer(tiny("ppo"), output_dir=tmp_path / "fresh").collector.collect(1).data.obs[:2]
    assert torch.equal(epochs[1].data.obs[:2], fresh) != continue_episodes


def test_continue_episodes_is_refused_in_the_async_mode():
    with pytest.raises(ConfigError, match="env.continue_episodes keeps episodes running"):
        tiny("ppo", **{"env.continue_episodes": True, "run.mode": "async"})


@pytest.mark.parametrize("env", ["Pendulum-v1", "flowrl/ObstaclePointMass-v0"])  # a flowrl id: registered in workers
def test_async_environments_give_the_sync_transitions_and_training(tmp_path, env):
    """`env.vectorization: async` steps each environment in its own process: the same rollouts (episodes carried
    across epochs, so resets inside an epoch are exercised too) and the same update as `sync`."""
    runs = {}
    for mode in ("sync", "async"):
        config = tiny("ppo", env, **{"env.vectorization": mode, "env.continue_episodes": True, "run.epochs": 2})
        trainer = build_trainer(config, output_dir=tmp_path / mode)
        trainer.train()
        runs[mode] = trainer
        assert trainer.collector.envs.closed  # train() closes the environments (async: ends the workers)
    sync, other = (dict(t.policy.named_parameters()) for t in (runs["sync"], runs["async"]))
    assert type(runs["async"].collector.envs).__name__ == "AsyncVectorEnv"
    for name, value in sync.items():
        assert torch.equal(value, other[name]), name
    with pytest.raises(ConfigError, match="vectorization"):
        tiny("ppo", **{"env.vectorization": "threads"})
