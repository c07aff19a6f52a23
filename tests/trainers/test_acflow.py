import dataclasses
import math

import pytest
import torch

from flowrl import rewards
from flowrl.config import ConfigError
from flowrl.policies import DiffusionPolicy
from flowrl.policies.fpo import cfm_losses
from flowrl.trainers import build_trainer, load_config
from flowrl.trainers.image.acflow import critic_weights

from .conftest import brightness, collected, make_trainer, micro_loss, training_rows


def acflow_config(tmp_path, overrides=(), **top):
    """`tiny_config`'s world and sizes for AC-Flow, sampling with the ODE."""
    data = {
        "trainer": "acflow",
        "sampling": {"num_steps": 4, "guidance_scale": 2.0, "sampler": "ode"},
        "batch": {"mini_batch_size": 16, "micro_batch_size": 8},
        "prompts": {"prompts_per_epoch": 4, "group_size": 4},
        "eval": {"every": 1, "samples_per_prompt": 2, "max_prompts": 4, "metrics": ["digits_gold"]},
        "optim": {"lr": 1e-3},
        "run": {"epochs": 2, "save_every": 1, "samples_every": 1, "log_with": [], "output_dir": str(tmp_path)},
        "critic": {"hidden": 16, "steps": 2, "warmup_epochs": 1},
        **top,
    }
    return load_config(data, list(overrides))


def _weights(module):
    return [p.detach().clone() for p in module.parameters()]


def _constant_critic(trainer, value: float):
    """Make the critic output `value` for every input (zero last layer, bias = value)."""
    net = trainer.engine.aux_module("critic")
    with torch.no_grad():
        net.head[-1].weight.zero_()
        net.head[-1].bias.fill_(value)


def test_weighting_functions_are_positive_finite_and_normalised_as_documented():
    adv = torch.tensor([[-2.0, 0.0], [2.0, 40.0]])
    exp = critic_weights(adv, "exp", 0.5)
    assert torch.allclose(exp, torch.tensor([[math.exp(-1), 1.0], [math.e, math.exp(20)]]))
    norm = critic_weights(adv, "exp_norm", 0.5)
    assert norm.mean().item() == pytest.approx(1.0) and torch.allclose(norm / norm[0, 1], exp / exp[0, 1])
    soft = critic_weights(adv, "softplus", 0.5)
    assert soft[0, 1].item() == pytest.approx(1.0)  # 1 at A = 0
    assert soft[0, 0].item() == pytest.approx(math.log1p(math.exp(-1)) / math.log(2))
    for w in (exp, norm, soft):
        assert (w > 0).all() and torch.isfinite(w).all()
    huge = critic_weights(torch.tensor([-1e4, 0.0, 1e4]), "exp_norm", 1.0)  # exp(1e4) overflows; softmax does not
    assert torch.isfinite(huge).all() and huge.tolist() == [0.0, 0.0, 3.0]
    with pytest.raises(ValueError, match="weighting must be one of"):
        critic_weights(adv, "identity", 1.0)


def test_reward_shaping_hand_values(tiny_world, tmp_path):
    r = {"digits_alignment": torch.tensor([0.0, 1.0, 2.0, 3.0])}
    groups, prompts = torch.tensor([0, 0, 1, 1]), ["a", "a", "b", "b"]
    batch = make_trainer(tiny_world, acflow_config(tmp_path, ["advantage.estimator=batch", "advantage.clip=1.0"]))
    shaped, _ = batch.algorithm.estimator(r, groups, prompts)
    z = 1.5 / (math.sqrt(5 / 3) + 1e-4)  # (3 - 1.5) / unbiased std of (0, 1, 2, 3)
    assert shaped.tolist() == pytest.approx([-1.0, -0.5 / 1.5 * z, 0.5 / 1.5 * z, 1.0], abs=1e-6)
    group = make_trainer(tiny_world, acflow_config(tmp_path, ["advantage.estimator=group", "advantage.clip=null"]))
    shaped, _ = group.algorithm.estimator(r, groups, prompts)
    g = 0.5 / (math.sqrt(0.5) + 1e-4)  # each pair: mean +- 0.5, unbiased std sqrt(0.5)
    assert shaped.tolist() == pytest.approx([-g, g, -g, g], abs=1e-6)
    raw = make_trainer(tiny_world, acflow_config(tmp_path, ["advantage.estimator=raw", "advantage.clip=2.5"]))
    assert raw.algorithm.estimator(r, groups, prompts)[0].tolist() == [0.0, 1.0, 2.0, 2.5]


def test_critic_targets_and_clipped_advantages(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, acflow_config(tmp_path, ["critic.steps=1", "critic.clip=1.0", "num_draws=3"]))
    algorithm = trainer.algorithm
    rollout, _, _ = trainer.collector.sample(0)
    shaped = torch.linspace(-3, 3, len(rollout))
    _constant_critic(trainer, 0.5)
    # the critic regresses the shaped reward: its (first) loss is mean((0.5 - r~)^2)
    rows = torch.arange(len(rollout))
    stats = algorithm.train_critic(rollout, rows, shaped, len(rollout), 0)
    assert stats["critic/loss"] == pytest.approx((0.5 - shaped).pow(2).mean().item(), rel=1e-6)
    _constant_critic(trainer, 0.5)
    every = torch.ones(len(rollout), dtype=torch.bool)
    draws, _ = algorithm.weigh_draws(collected(rollout), shaped, every, epoch=1)  # after the warm-up: the critic's
    adv = algorithm.critic_advantages(rollout, shaped, draws)
    assert adv.shape == (len(rollout), 3) and adv.abs().max() <= 1.0
    assert torch.allclose(adv, (shaped - 0.5).clamp(-1, 1)[:, None].expand(-1, 3))
    assert torch.allclose(draws.weights, critic_weights(adv, "exp_norm", 1.0))


def test_warmup_weights_ignore_the_critic(tiny_world, tmp_path):
    config = acflow_config(tmp_path, ["critic.warmup_epochs=2", "weight_fn=exp", "temperature=0.5"])
    trainer = make_trainer(tiny_world, config)
    rollout, _, _ = trainer.collector.sample(0)
    shaped, every = torch.linspace(-1, 1, len(rollout)), torch.ones(len(rollout), dtype=torch.bool)
    for value in (0.0, 3.0):  # whatever the critic says, the warm-up weight is g(r~) = exp(beta r~)
        _constant_critic(trainer, value)
        draws, _ = trainer.algorithm.weigh_draws(collected(rollout), shaped, every, epoch=1)
        assert torch.allclose(draws.weights, torch.exp(0.5 * shaped)[:, None].expand(-1, 2))


def test_frozen_warmup_leaves_the_actor_bit_identical(tiny_world, tmp_path):
    config = acflow_config(tmp_path, ["critic.warmup_epochs=2", "warmup_actor=frozen", "run.epochs=3"])
    trainer = make_trainer(tiny_world, config)
    actor, critic = _weights(trainer.policy.model), _weights(trainer.algorithm.critic)
    for epoch in range(2):
        record = trainer.train_epoch(epoch)
        assert record["critic/warmup"] == 1.0 and "loss" not in record
        assert all(torch.equal(a, b) for a, b in zip(actor, _weights(trainer.policy.model)))
    assert all(not torch.equal(a, b) for a, b in zip(critic, _weights(trainer.algorithm.critic)))
    record = trainer.train_epoch(2)  # the warm-up is over: the critic-weighted actor trains
    assert record["critic/warmup"] == 0.0 and math.isfinite(record["loss"])
    assert all(not torch.equal(a, b) for a, b in zip(actor, _weights(trainer.policy.model)))


def test_reduction_to_orw_cfm_w2(tiny_world, tmp_path):
    """V = 0, g = exp(beta r) on raw rewards, no clipping: exactly ORW-CFM-W2's loss (markerthu/orw-cfm)."""
    overrides = [
        "advantage.estimator=raw",
        "advantage.clip=null",
        "critic.clip=null",
        "weight_fn=exp",
        "temperature=0.5",
        "kl.beta=1.0",
        "critic.warmup_epochs=0",
        "critic.steps=0",
    ]
    trainer = make_trainer(tiny_world, acflow_config(tmp_path, overrides))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the actor off the reference so that the W2 term is not zero
        for p in trainer.policy.model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    _constant_critic(trainer, 0.0)
    rollout, prompts, _ = trainer.collector.sample(0)
    raw = torch.rand(len(rollout), generator=g)
    shaped, _ = trainer.algorithm.estimator(
        {"digits_alignment": raw}, torch.zeros(len(rollout), dtype=torch.long), [str(p) for p in prompts]
    )
    assert torch.equal(shaped, raw)
    every = torch.ones(len(rollout), dtype=torch.bool)
    draws, _ = trainer.algorithm.weigh_draws(collected(rollout), shaped, every, epoch=0)
    rollout = dataclasses.replace(rollout, draws=draws)
    second = torch.ones(len(rollout), 1, dtype=torch.long)  # the second stored draw of every sample
    loss, metrics = micro_loss(trainer, rollout, index=second)
    actor = [p for p in trainer.policy.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, actor, allow_unused=True)

    # ORW-CFM-W2 written out with the policy's own FPO machinery and an independent base model as reference
    taus, noises = draws.taus[:, 1], draws.noises[:, 1]
    x1 = rollout.latents[:, -1]
    velocity = trainer.policy.velocity_fn(rollout, 1)
    reference = tiny_world.policy(forward_batch_size=8).velocity_fn(rollout, 1)
    fm = cfm_losses(velocity, x1, taus[:, None], noises[:, None])[:, 0]  # ||v - (eps - x1)||^2, element mean
    x_t = (1 - taus[:, None, None, None]) * x1 + taus[:, None, None, None] * noises
    w2 = (velocity(x_t, taus) - reference(x_t, taus).detach()).pow(2).flatten(1).mean(-1)
    expected = torch.mean(torch.exp(0.5 * raw) * fm + 1.0 * w2)
    expected_grads = torch.autograd.grad(expected, actor, allow_unused=True)
    assert w2.mean() > 0 and metrics["w2_loss"].item() == pytest.approx(w2.mean().item(), rel=1e-4)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for a, b in zip(grads, expected_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_w2_term_is_zero_at_the_reference(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, acflow_config(tmp_path, ["kl.beta=1.0"]))
    rollout, _, _ = trainer.collector.sample(0)
    every = torch.ones(len(rollout), dtype=torch.bool)
    draws, _ = trainer.algorithm.weigh_draws(collected(rollout), torch.linspace(-1, 1, len(rollout)), every, 0)
    rollout = dataclasses.replace(rollout, draws=draws)
    first = torch.zeros(len(rollout), 1, dtype=torch.long)
    actor = [p for p in trainer.policy.model.parameters() if p.requires_grad]
    loss, metrics = micro_loss(trainer, rollout, index=first)
    assert metrics["w2_loss"].item() == 0.0
    with_w2 = torch.autograd.grad(loss, actor, allow_unused=True)
    trainer.config.kl.beta = 0.0
    loss0, metrics0 = micro_loss(trainer, rollout, index=first)
    assert "w2_loss" not in metrics0 and loss0.item() == loss.item()
    for a, b in zip(with_w2, torch.autograd.grad(loss0, actor, allow_unused=True)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_velocity_follows_the_policys_velocity_fn(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, acflow_config(tmp_path))
    rollout, _, _ = trainer.collector.sample(0)
    x, t = torch.randn(rollout.latents[:, -1].shape), torch.rand(len(rollout))
    with torch.no_grad():
        velocity = trainer.algorithm.velocity
        assert torch.allclose(velocity(rollout, x, t), trainer.policy.velocity_fn(rollout, 1)(x, t), atol=1e-6)
        # the base and the reference agree before any update
        assert torch.equal(velocity(rollout, x, t), velocity(rollout, x, t, reference=True))


def test_two_epoch_run_trains_actor_and_critic(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, acflow_config(tmp_path))  # epoch 1: reward-weighted warm-up; epoch 2: critic
    actor, critic = _weights(trainer.policy.model), _weights(trainer.algorithm.critic)
    summary = trainer.train()
    assert all(not torch.equal(a, b) for a, b in zip(actor, _weights(trainer.policy.model)))
    assert all(not torch.equal(a, b) for a, b in zip(critic, _weights(trainer.algorithm.critic)))
    lines = training_rows(tmp_path)
    assert [r["critic/warmup"] for r in lines] == [1.0, 0.0]
    for record in lines:
        for key in (
            "reward/mean",
            "loss",
            "cfm_loss",
            "w2_loss",
            "weight_mean",
            "critic/loss",
            "adv/critic_std",
            "weight/max",
            "grad_norm",
            "eval/digits_gold",
        ):
            assert key in record and math.isfinite(record[key]), key
    assert math.isfinite(summary["gold_end"])


def test_resume_is_exact_including_the_critic(tiny_world, tmp_path):
    straight = make_trainer(tiny_world, acflow_config(tmp_path / "a", ["run.epochs=4"]))
    straight.train()
    first = make_trainer(tiny_world, acflow_config(tmp_path / "b", ["run.epochs=2"]))
    first.train()
    resumed = make_trainer(tiny_world, acflow_config(tmp_path / "b", ["run.epochs=4"]))
    resumed.train(resume=True)
    for a, b in [(straight.policy.model, resumed.policy.model), (straight.algorithm.critic, resumed.algorithm.critic)]:
        assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(b)))
    history = lambda path: [r["reward/mean"] for r in training_rows(path)]  # noqa: E731
    assert history(tmp_path / "a") == history(tmp_path / "b")


def test_config_and_model_checks(tiny_world, unet_pipe, tmp_path):
    with pytest.raises(ConfigError, match="group_size >= 2"):
        acflow_config(tmp_path, ["advantage.estimator=group", "prompts.group_size=1"])
    with pytest.raises(ConfigError, match="weight_fn"):
        acflow_config(tmp_path, ["weight_fn=identity"])
    with pytest.raises(ConfigError, match="'alpha' was renamed: use kl.beta"):
        acflow_config(tmp_path, ["alpha=0.5"])
    with pytest.raises(ConfigError, match="'adv_clip' was renamed: use critic.clip"):
        acflow_config(tmp_path, ["adv_clip=0.5"])
    with pytest.raises(ConfigError, match="'critic_steps' was renamed: use critic.steps"):
        acflow_config(tmp_path, ["critic_steps=1"])
    with pytest.raises(ConfigError, match="'objective' does not apply to trainer 'acflow': this trainer's loss is"):
        acflow_config(tmp_path, ["objective.name=gspo"])  # critic-weighted flow matching has no ratio objective
    config = acflow_config(tmp_path)
    fns = {"digits_alignment": rewards.get("digits_alignment", classifiers=tiny_world.classifiers)}
    with pytest.raises(ValueError, match="needs a flow-matching"):
        build_trainer(config, policy=DiffusionPolicy.from_pipeline(unet_pipe), reward_fns=fns, eval_fns={})


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_trains_with_lora_on_tiny_sd3_and_flux_pipelines(family, tmp_path):
    """Packed Flux latents, CFG / guidance embeddings, and the W2 reference as the network with LoRA disabled."""
    from flowrl.models import tiny_flux, tiny_sd3

    pipe = (tiny_sd3 if family == "sd3" else tiny_flux)(seed=1)
    policy = DiffusionPolicy.from_pipeline(pipe, forward_batch_size=2, max_sequence_length=16)
    policy.add_lora(rank=4)
    overrides = [
        "sampling.num_steps=2",
        "batch.micro_batch_size=2",
        "batch.mini_batch_size=2",
        "prompts.prompts_per_epoch=2",
        "prompts.group_size=2",
        "eval.max_prompts=1",
        "run.epochs=1",
        "rewards=[{name: brightness}]",
        "eval.metrics=[]",
        "critic.warmup_epochs=0",
    ]
    config = acflow_config(tmp_path, overrides, sampling={"num_steps": 2, "guidance_scale": 3.5, "sampler": "ode"})
    trainer = build_trainer(config, policy=policy, reward_fns={"brightness": brightness}, eval_fns={})
    assert policy.reference_model is None  # LoRA: the reference is the base with its adapter disabled
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainer.params]
    record = trainer.train_epoch(0)
    assert math.isfinite(float(record["loss"])) and math.isfinite(record["critic/loss"])
    assert record["w2_loss"] > 0  # LoRA starts at the base (B = 0); after the first step the actor has left it
    unchanged = [n for n, a, b in zip(names, before, trainer.params) if torch.equal(a, b)]
    # SD3's last block discards its text stream, so the text queries of that block get no gradient
    assert all(".1.attn.add_q_proj." in n for n in unchanged) and len(unchanged) < len(names), unchanged
