"""TempFlow-GRPO's branching, per-column advantages and noise-aware weights; shared initial noise per group."""

from types import SimpleNamespace

import pytest
import torch

from flowrl.core import step_weights
from flowrl.trainers import load_config

from .conftest import elements, make_trainer, tiny_config


BRANCHING = ["seeds_per_prompt=2", "branches=2", "prompts.group_size=12", "objective.clip_eps_low=1e-2"]


def test_noise_aware_weights_reproduce_tempflows_sd35_values():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    s = step_weights("noise_aware", scheduler.sigmas.float())  # [10], the flow-SDE std at a = 1
    c = 1 / (0.7 * s[:9].mean())  # the authors' constant for a = 0.7 over the 9 trained steps
    assert abs(c.item() - 2.252) < 1e-3
    expected = torch.tensor([1.58, 1.67, 1.21, 1.00, 0.88, 0.79, 0.72, 0.64, 0.51])
    assert torch.allclose(s[:9] / s[:9].mean(), expected, atol=0.01)


def test_group_size_must_be_seeds_times_branches_times_steps():
    with pytest.raises(ValueError, match=r"4 x 6 x 9 = 216, got 8"):
        load_config({"trainer": "tempflow_grpo"})
    assert load_config({"trainer": "tempflow_grpo", "prompts": {"group_size": 216}}).branch_steps() == list(range(9))
    with pytest.raises(ValueError, match="steps.selection must be one of all, first_fraction, window"):
        load_config({"trainer": "tempflow_grpo", "prompts": {"group_size": 216}, "steps": {"selection": "random"}})


def test_branches_leave_their_seeds_trunk_at_one_step(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, tiny_config("tempflow_grpo", tmp_path, overrides=BRANCHING))
    assert trainer.algorithm.branch_steps == [0, 1, 2]  # 99% of 4 steps
    rollout, prompts, _ = trainer.collector.sample(0)
    g = 12
    for group in range(len(rollout) // g):
        rows = torch.arange(group * g, (group + 1) * g)
        for i in rows.tolist():
            n, j, k = trainer.algorithm.branch_of(i)
            assert rollout.stochastic_step[i].item() == j and rollout.mask[i].nonzero().flatten().tolist() == [j]
            assert (rollout.log_probs[i] != 0).nonzero().flatten().tolist() == [j]
            sibling = group * g + n * 6 + (i % 6 // 2) * 2 + (1 - k)  # same seed and step, the other branch
            # the two branches start the step from the identical trunk state and then differ
            assert torch.equal(rollout.latents[i, : j + 1], rollout.latents[sibling, : j + 1])
            assert not torch.equal(rollout.latents[i, j + 1], rollout.latents[sibling, j + 1])
            other_seed = group * g + (1 - n) * 6 + i % 6
            assert not torch.equal(rollout.latents[i, 0], rollout.latents[other_seed, 0])
        # the seed's trunk: the same ODE states up to where either sample branches (sampled in separate calls
        # per branch step, so equal up to float reordering)
        seed = rows[:6]
        for a in seed.tolist():
            for b in seed.tolist():
                m = min(rollout.stochastic_step[a].item(), rollout.stochastic_step[b].item())
                assert torch.allclose(rollout.latents[a, : m + 1], rollout.latents[b, : m + 1], atol=1e-5)
    assert torch.equal(elements(trainer, rollout, 0), rollout.stochastic_step[:, None])


def test_each_branch_step_is_its_own_baseline_group(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, tiny_config("tempflow_grpo", tmp_path, overrides=BRANCHING))
    texts = [str(p) for p in trainer.collector.epoch_prompts(0)]
    keys = trainer.algorithm.group_keys(texts)
    assert len(set(keys)) == 4 * 3  # 4 prompts x 3 branch steps, 4 samples each (2 seeds x 2 branches)
    ids = torch.tensor([sorted(set(keys)).index(k) for k in keys])
    rewards = {"digits_alignment": torch.rand(len(texts), generator=torch.Generator().manual_seed(0))}
    adv, _ = trainer.algorithm.estimator(rewards, ids, texts)
    for g in ids.unique():
        assert abs(adv[ids == g].mean().item()) < 1e-6 and (ids == g).sum() == 4


def test_weights_are_noise_aware_normalised_over_the_branch_steps(tiny_world, tmp_path):
    trainer = make_trainer(tiny_world, tiny_config("tempflow_grpo", tmp_path, overrides=BRANCHING))
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    w = trainer.algorithm.step_terms.weight(SimpleNamespace(sigmas=sigmas), torch.tensor([0, 1, 2]))
    raw = step_weights("noise_aware", sigmas)[:3]
    assert torch.allclose(w, raw / raw.mean()) and abs(w.mean().item() - 1) < 1e-6


def test_init_same_noise_gives_a_group_one_initial_noise(tiny_world, tmp_path):
    config = tiny_config("flow_grpo", tmp_path, overrides=["sampling.init_same_noise=true"])
    trainer = make_trainer(tiny_world, config)
    rollout, _, _ = trainer.collector.sample(0)
    x0 = rollout.latents[:, 0].reshape(4, 4, -1)  # 4 groups of 4
    assert all(torch.equal(x0[g, 0], x0[g, i]) for g in range(4) for i in range(4))
    assert not torch.equal(x0[0, 0], x0[1, 0])
    assert not torch.equal(rollout.latents[0, -1], rollout.latents[1, -1])  # the SDE noise still differs
    again, _, _ = make_trainer(tiny_world, config).collector.sample(0)  # every process, and a resumed run
    assert torch.equal(again.latents, rollout.latents)
