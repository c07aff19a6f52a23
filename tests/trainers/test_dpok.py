"""DPOK's own pieces (replay buffer, value baseline, clamp gating, per-step KL and its warm-up) and its runs."""

import math

import pytest
import torch

from flowrl.config import ConfigError
from flowrl.image.steps import step_kl
from flowrl.policies import Transitions
from flowrl.policies.rollout import Collected
from flowrl.run.scheduler import UpdateBatch
from flowrl.runtime import seeded
from flowrl.trainers import build_trainer, load_config
from flowrl.trainers.image.dpok import ReplayBuffer

from .conftest import brightness, make_trainer, tiny_config, training_rows


def dpok_config(tmp_path, overrides=(), clip=1e-2, kl=0.1, **top):
    """`tiny_config`'s 2-epoch digits run (4 prompts x 4 samples, 4 steps, CFG 2) at DPOK's tiny sizes.

    64 transitions per epoch into a buffer of 48, so the FIFO drops transitions during the run. Weight decay as
    the other trainers' tiny runs: the 1-layer transformer's last context query projection does not reach the
    output, so only weight decay moves it. `clip` is the clamp's half-width, `kl` the KL's beta (or a dict).
    """
    tiny = {
        "objective": {"clip_eps_low": clip},
        "kl": kl if isinstance(kl, dict) else {"beta": kl},
        "buffer_size": 48,
        "policy_steps": 2,
        "batch": {"mini_batch_size": 16, "micro_batch_size": 8},
        "critic": {"mini_batch_size": 32, "hidden": 16},
        "optim": {"lr": 1e-3, "weight_decay": 1e-4},
    }
    return tiny_config("dpok", tmp_path, overrides, **{**tiny, **top})


def step_loss(trainer, batch, adv):
    """DPOK's loss of buffer transitions `batch` with advantages `adv` (alpha applied) and its metrics."""
    n = len(batch)
    update = UpdateBatch(
        data=batch,
        rows=None,
        size=n,
        advantages=trainer.config.reward_weight * adv,
        trainable=torch.ones(n, dtype=torch.bool),
    )
    return trainer.scheduler.loss(trainer.scheduler.micro_batch(update))


def transitions(trainer, rollout, rewards, keep, epoch=0):
    """The buffer transitions of a rollout that is one process's whole epoch."""
    collected = Collected(data=rollout, rows=torch.arange(len(rollout)), size=len(rollout))
    return trainer.algorithm.transitions(collected, rewards, keep, epoch)


def _rows(values):
    """Transitions whose every field encodes its value (states `[n, 1, 2]`), to follow rows through the buffer."""
    v = torch.tensor(values, dtype=torch.float32)
    states = v[:, None, None].expand(-1, 1, 2)
    return Transitions(
        states=states.clone(),
        next_states=-states,
        steps=v.long(),
        prompts=v.long() + 100,
        log_probs=v / 10,
        rewards=v * 2,
    )


def _consistent(t):
    v = t.states[:, 0, 0]
    return (
        torch.equal(t.next_states[:, 0, 1], -v)
        and torch.equal(t.steps, v.long())
        and torch.equal(t.prompts, v.long() + 100)
        and torch.equal(t.log_probs, v / 10)
        and torch.equal(t.rewards, v * 2)
    )


def _fresh_batch(trainer, n=11, seed=0):
    """`n` random transitions of one fresh epoch-0 rollout (the trainer's settings set as in `update`)."""
    rollout, _, _ = trainer.collector.sample(0)
    trainer.algorithm.settings = rollout
    rewards = torch.linspace(0, 1, len(rollout))
    fresh = transitions(trainer, rollout, rewards, torch.ones(len(rollout), dtype=torch.bool))
    return fresh.select(torch.randperm(len(fresh), generator=torch.Generator().manual_seed(seed))[:n])


def _grads(trainer, loss):
    return torch.autograd.grad(loss, trainer.params, allow_unused=True)


def _norm(grads):
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads if g is not None))


# ----------------------------------------------------------------------------------------------
# the replay buffer
# ----------------------------------------------------------------------------------------------


def test_buffer_is_a_fifo_with_a_capacity():
    buffer = ReplayBuffer(5)
    assert len(buffer) == 0 and buffer.state_dict() == {}
    buffer.push(_rows([0, 1, 2]))
    assert buffer.data.rewards.tolist() == [0, 2, 4]
    buffer.push(_rows([3, 4, 5, 6]))  # 7 pushed, capacity 5: 0 and 1 (the oldest) are gone
    assert len(buffer) == 5 and buffer.data.steps.tolist() == [2, 3, 4, 5, 6] and _consistent(buffer.data)
    buffer.push(_rows(list(range(10, 18))))  # more than the capacity at once: the newest 5 of them
    assert buffer.data.steps.tolist() == [13, 14, 15, 16, 17] and _consistent(buffer.data)
    assert buffer.data.states.device.type == "cpu"
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ReplayBuffer(0)
    with pytest.raises(ValueError, match="empty"):
        ReplayBuffer(3).sample(2, torch.Generator())


def test_buffer_sampling_is_seeded_distinct_and_round_trips():
    buffer = ReplayBuffer(100)
    buffer.push(_rows(list(range(40))))
    a = buffer.sample(16, torch.Generator().manual_seed(3))
    b = buffer.sample(16, torch.Generator().manual_seed(3))
    c = buffer.sample(16, torch.Generator().manual_seed(4))
    assert torch.equal(a.steps, b.steps) and not torch.equal(a.steps, c.steps)
    assert len(set(a.steps.tolist())) == 16 and _consistent(a)  # distinct rows, fields stay together
    assert sorted(buffer.sample(99, torch.Generator()).steps.tolist()) == list(range(40))  # at most everything
    restored = ReplayBuffer(100)
    restored.load_state_dict(buffer.state_dict())
    fields = Transitions.per_sample_fields()
    assert all(torch.equal(getattr(restored.data, k), getattr(buffer.data, k)) for k in fields)
    empty = ReplayBuffer(3)
    empty.load_state_dict({})
    assert len(empty) == 0


def test_transitions_are_every_stochastic_step_of_the_kept_samples(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, dpok_config(tmp_path))
    rollout, _, _ = trainer.collector.sample(0)
    rewards = torch.arange(16.0) / 16
    keep = torch.ones(16, dtype=torch.bool)
    keep[3] = False  # e.g. a NaN reward
    t = transitions(trainer, rollout, rewards, keep)
    rows = torch.tensor([i for i in range(16) if i != 3]).repeat_interleave(4)
    steps = torch.arange(4).repeat(15)  # trajectory by trajectory: a full buffer drops whole trajectories
    assert len(t) == 60 and torch.equal(t.steps, steps)
    assert torch.equal(t.states, rollout.latents[rows, steps])
    assert torch.equal(t.next_states, rollout.latents[rows, steps + 1])
    assert torch.equal(t.log_probs, rollout.log_probs[rows, steps]) and torch.equal(t.rewards, rewards[rows])
    table = trainer.algorithm.prompt_table
    assert [table[i] for i in t.prompts.tolist()] == [rollout.prompts[i] for i in rows.tolist()]


# ----------------------------------------------------------------------------------------------
# re-scoring, the value baseline, the clamp, the KL
# ----------------------------------------------------------------------------------------------


def test_fresh_transitions_rescore_exactly_and_the_kl_starts_at_zero(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, dpok_config(tmp_path, kl=0.1))
    assert trainer.policy.reference_model is not None  # full fine-tuning: a frozen copy of the base
    batch = _fresh_batch(trainer, n=11)  # 11 random rows of 64: chunks of 8 with padding, any order
    loss, metrics = step_loss(trainer, batch, torch.ones(11))
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1  # bit-exact: rho = 1 before any update
    assert metrics["clipfrac"] == 0 and metrics["kl"] == 0
    assert loss.item() == pytest.approx(-trainer.config.reward_weight)  # -alpha mean(A clamp(1)) with A = 1
    # one element per transition, at its denoising step: the per-step rows count the steps of the minibatch
    assert metrics["count_per_step"].tolist() == torch.bincount(batch.steps, minlength=4).float().tolist()


def test_value_net_regresses_the_stored_final_rewards(tiny_world, tmp_path):
    critic = {"lr": 1e-2, "steps": 1, "mini_batch_size": 32, "hidden": 16}
    trainer = make_trainer(tiny_world, dpok_config(tmp_path, critic=critic))
    algorithm = trainer.algorithm
    rollout, _, _ = trainer.collector.sample(0)
    algorithm.settings = rollout
    algorithm.buffer.push(transitions(trainer, rollout, torch.full((16,), 0.7), torch.ones(16, dtype=torch.bool)))
    # the logged value loss is the MSE of V(x_t, sigma_t, c) to the stored rewards of the sampled transitions
    batch = algorithm.buffer.sample(32, seeded(5))
    with torch.no_grad():
        expected = ((algorithm.value(batch) - 0.7) ** 2).mean().item()
    assert algorithm.fit_value(seeded(5)) == pytest.approx(expected, rel=1e-5)
    for i in range(60):
        algorithm.fit_value(seeded(6, i))
    with torch.no_grad():
        values = algorithm.value(algorithm.buffer.data)
    assert expected > 0.01 and (values - 0.7).abs().max() < 0.05


def test_clamp_gates_the_gradient_outside_the_band_for_both_signs(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, dpok_config(tmp_path, kl=0.0, clip=1e-2))
    batch = _fresh_batch(trainer, n=8)
    alpha = trainer.config.reward_weight

    def grad_norm(shift, sign):
        shifted = batch.select(slice(None))
        shifted.log_probs = batch.log_probs - shift  # rho = exp(shift), exactly, for every transition
        loss, metrics = step_loss(trainer, shifted, sign * torch.ones(8))
        assert metrics["ratio_mean"].item() == pytest.approx(math.exp(shift), rel=1e-6)
        return _norm(_grads(trainer, loss))

    for sign in (1.0, -1.0):
        assert grad_norm(0.005, sign) > 0 and grad_norm(-0.005, sign) > 0  # inside (1 - eps, 1 + eps)
        assert grad_norm(0.02, sign) == 0 and grad_norm(-0.02, sign) == 0  # outside: no gradient, either sign
    # at rho = 1 the gradient is REINFORCE with the reward weight: -alpha mean(A grad log p)
    adv = torch.linspace(-1, 1, 8)
    loss, _ = step_loss(trainer, batch, adv)
    out = trainer.policy.score_transitions(
        trainer.algorithm.settings,
        batch.states,
        batch.next_states,
        batch.steps,
        trainer.algorithm.conditioning(batch.prompts),
    )
    reinforce = -alpha * (adv * out.log_prob).mean()
    for g, r in zip(_grads(trainer, loss), _grads(trainer, reinforce)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-7)


def test_gaussian_kl_matches_torch_distributions_and_warms_up(tiny_world, tmp_path):
    kl = {"beta": 0.5, "warmup_epochs": 1, "form": "gaussian"}
    trainer = make_trainer(tiny_world, dpok_config(tmp_path, kl=kl, clip=1e-3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the policy away from its frozen reference
        for p in trainer.params:
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    batch = _fresh_batch(trainer, n=8)
    cond = trainer.algorithm.conditioning(batch.prompts)
    args = (trainer.algorithm.settings, batch.states, batch.next_states, batch.steps, cond)
    out = trainer.policy.score_transitions(*args)
    ref = trainer.policy.score_transitions(*args, reference=True)
    kl = step_kl("gaussian", out, ref)
    std = out.std[:, None, None, None].expand_as(out.mean)
    normal = torch.distributions.Normal
    expected = torch.distributions.kl_divergence(normal(out.mean, std), normal(ref.mean, std)).flatten(1).mean(1)
    assert (kl > 0).all()
    torch.testing.assert_close(kl, expected, rtol=1e-5, atol=1e-9)

    # warm-up: the KL is computed (and logged) in epoch 0 but enters the loss from epoch kl_warmup = 1 on
    far = batch.select(slice(None))
    far.log_probs = batch.log_probs - 1.0  # every ratio far outside the clamp: only the KL can have a gradient
    adv = torch.ones(8)
    trainer.algorithm.epoch = 0
    loss0, metrics0 = step_loss(trainer, far, adv)
    alpha = trainer.config.reward_weight
    # far outside the clamp the value is -alpha A (1 - eps) for every row: the objective's part, nothing else
    assert metrics0["kl"] > 0 and loss0.item() == pytest.approx(metrics0["pg_loss"].item())
    assert metrics0["pg_loss"].item() == pytest.approx(-alpha * (1 + 1e-3), rel=1e-6)
    assert _norm(_grads(trainer, loss0)) == 0
    trainer.algorithm.epoch = 1
    loss1, metrics1 = step_loss(trainer, far, adv)
    assert loss1.item() == pytest.approx(loss0.item() + 0.5 * metrics1["kl"].item(), rel=1e-5)
    kl_grad = _grads(trainer, 0.5 * step_kl("gaussian", trainer.policy.score_transitions(*args), ref).mean())
    for a, b in zip(_grads(trainer, loss1), kl_grad):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)
    assert trainer.config.kl.coef(0) == 0.0 and trainer.config.kl.coef(1) == 0.5


# ----------------------------------------------------------------------------------------------
# runs
# ----------------------------------------------------------------------------------------------


def test_two_epoch_run_trains_every_parameter_and_the_value_net(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, dpok_config(tmp_path, kl=0.1))
    value = trainer.engine.aux["value"][0]
    before = [p.detach().clone() for p in trainer.params]
    value_before = [p.detach().clone() for p in value.parameters()]
    trainer.train()
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.params)), "a policy parameter did not change"
    assert all(not torch.equal(a, b) for a, b in zip(value_before, value.parameters())), "a value parameter did not"
    lines = training_rows(tmp_path)
    assert [r["buffer_size"] for r in lines] == [48, 48]  # 64 transitions per epoch, capacity 48
    for record in lines:
        for key in (
            "loss",
            "pg_loss",
            "kl",
            "value_loss",
            "clipfrac",
            "ratio_mean",
            "approx_kl",
            "grad_norm",
            "advantage_mean",
            "ratio_mean/step_0",
            "ratio_std/step_3",
            "eval/digits_gold",
        ):
            assert key in record and math.isfinite(record[key]), key
    assert lines[1]["kl"] > 0  # the policy left its reference


def test_resume_is_exact_including_the_value_net_and_the_buffer(tiny_world, tmp_path):
    def run(folder, epochs, resume=False):
        # a buffer of 100 > 64 transitions per epoch: the resumed run needs the checkpoint's buffer
        config = dpok_config(folder, overrides=[f"run.epochs={epochs}"], kl=0.1, buffer_size=100)
        trainer = make_trainer(tiny_world, config)
        trainer.train(resume=resume)
        return trainer

    straight = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    resumed = run(tmp_path / "b", 4, resume=True)
    for a, b in zip(straight.params, resumed.params):
        assert torch.equal(a, b)
    for a, b in zip(straight.engine.aux["value"][0].parameters(), resumed.engine.aux["value"][0].parameters()):
        assert torch.equal(a, b)
    for name in Transitions.per_sample_fields():
        a, b = straight.algorithm.buffer.data, resumed.algorithm.buffer.data
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    history = lambda path: training_rows(path)  # noqa: E731
    a, b = history(tmp_path / "a"), history(tmp_path / "b")
    assert [r["value_loss"] for r in a] == [r["value_loss"] for r in b] and len(b) == 4


def test_without_value_the_advantage_is_the_reward(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, dpok_config(tmp_path, overrides=["run.epochs=1", "critic.enabled=false"]))
    assert trainer.engine.aux == {} and trainer.algorithm.value_net is None
    batch, _, _ = trainer.prepare_epoch(0)
    # A = alpha r exactly, for every buffer transition
    assert torch.equal(batch.advantages, trainer.config.reward_weight * batch.data.rewards)
    record = trainer.train_epoch(1)
    # the logged mean advantage of the drawn transitions is a mean of the rewards (alpha 1000)
    assert "value_loss" not in record and record["advantage_mean"] == pytest.approx(
        1000 * float(record["reward/mean"]), abs=200
    )


def test_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="batch.inner_epochs must be 1"):
        dpok_config(tmp_path, overrides=["batch.inner_epochs=2"])
    with pytest.raises(ConfigError, match="'policy_batch_size' was renamed: use batch.mini_batch_size"):
        dpok_config(tmp_path, policy_batch_size=8)
    with pytest.raises(ConfigError, match="'value_lr' was renamed: use critic.lr"):
        dpok_config(tmp_path, value_lr=1e-3)
    with pytest.raises(ConfigError, match="'drop_zero_std_groups' does not apply to trainer 'dpok': dpok stores"):
        dpok_config(tmp_path, drop_zero_std_groups=True)
    with pytest.raises(ConfigError, match="kl.form 'k3' is not one of dpok's: gaussian, gaussian_dt, eps_mse"):
        dpok_config(tmp_path, kl={"form": "k3"})
    with pytest.raises(ConfigError, match="'kl_weight' was renamed: use kl.beta"):
        dpok_config(tmp_path, kl_weight=0.1)
    defaults = load_config({"trainer": "dpok"})
    assert (defaults.optim.lr, defaults.optim.max_grad_norm) == (1e-5, 0.1)
    assert (defaults.batch.mini_batch_size, defaults.batch.micro_batch_size) == (24, 2)  # 12 minibatches of 2
    assert (defaults.reward_weight, defaults.kl.beta, defaults.objective.clip_eps_low) == (1000, 0.1, 1e-4)
    assert (defaults.objective.name, defaults.advantage.estimator) == ("clamp", "raw")
    # beta 0.1 is DPOK's value for its code's KL (the unweighted prediction MSE), so that is the default form
    assert defaults.kl.form == "eps_mse"
    assert (defaults.buffer_size, defaults.policy_steps, defaults.critic.mini_batch_size) == (1000, 5, 1280)


# ----------------------------------------------------------------------------------------------
# the paper's setting: a UNet with DDIM (eta 1), CFG and LoRA
# ----------------------------------------------------------------------------------------------


@pytest.mark.long
def test_ddim_unet_with_lora(tmp_path):
    from flowrl.models import tiny_unet
    from flowrl.policies import DiffusionPolicy

    (tmp_path / "prompts.txt").write_text("a photo of a cat\na red dog\na blue bird\na green frog\n")
    prompts = str(tmp_path / "prompts.txt")
    config = load_config(
        {
            "trainer": "dpok",
            "sampling": {"num_steps": 3, "guidance_scale": 2.0, "noise_level": 1.0, "sampler": "ddim"},
            "batch": {"mini_batch_size": 4, "micro_batch_size": 2},
            "prompts": {"train": prompts, "test": prompts, "prompts_per_epoch": 2, "group_size": 2},
            "rewards": [{"name": "brightness"}],
            "eval": {"every": 0, "samples_per_prompt": 1, "max_prompts": 2},
            "optim": {"lr": 1e-3},
            "run": {
                "epochs": 2,
                "save_every": 0,
                "samples_every": 0,
                "log_with": [],
                "output_dir": str(tmp_path / "run"),
            },
            "kl": {"beta": 0.1, "form": "eps_mse"},
            "objective": {"clip_eps_low": 1e-2},
            "policy_steps": 2,
            "critic": {"mini_batch_size": 8, "hidden": 16},
        }
    )
    policy = DiffusionPolicy.from_pipeline(tiny_unet(), forward_batch_size=2)
    policy.add_lora(rank=4)
    trainer = build_trainer(config, policy=policy, reward_fns={"brightness": brightness}, eval_fns={})
    assert trainer.policy.reference_model is None  # the reference is the UNet with its LoRA disabled

    batch = _fresh_batch(trainer, n=5)
    _, metrics = step_loss(trainer, batch, torch.ones(5))
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1 and metrics["kl"] == 0  # exact DDIM re-scoring

    # eps_mse is the exact Gaussian KL without DDIM's per-step weight w_t (analytic, sec. 5.2 of the notes)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    cond = trainer.algorithm.conditioning(batch.prompts)
    args = (trainer.algorithm.settings, batch.states, batch.next_states, batch.steps, cond)
    out, eps = trainer.policy.score_transitions(*args, return_prediction=True)
    ref, ref_eps = trainer.policy.score_transitions(*args, reference=True, return_prediction=True)
    scheduler = trainer.policy.adapter.scheduler
    t = trainer.algorithm.settings.timesteps.cpu()[batch.steps]
    prev = t - scheduler.config.num_train_timesteps // 3
    a = scheduler.alphas_cumprod[t]
    a_prev = torch.where(prev >= 0, scheduler.alphas_cumprod[prev.clamp(min=0)], scheduler.final_alpha_cumprod)
    s = out.std
    w = ((1 - a_prev - s**2).sqrt() - (a_prev * (1 - a) / a).sqrt()) ** 2 / (2 * s**2)
    gaussian = step_kl("gaussian", out, ref)
    mse = step_kl("eps_mse", out, ref, prediction=eps, ref_prediction=ref_eps)
    assert (mse > 0).all()
    torch.testing.assert_close(gaussian, w * mse, rtol=1e-3, atol=1e-9)

    trainer.train()
    record = training_rows(tmp_path / "run")[-1]
    assert math.isfinite(record["loss"]) and record["kl"] > 0 and record["buffer_size"] == 2 * 4 * 3
    assert all(torch.isfinite(p).all() for p in trainer.params)
