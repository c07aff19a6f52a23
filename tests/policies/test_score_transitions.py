"""`DiffusionPolicy.score_transitions`: re-scoring single transitions taken out of their rollouts (replay buffers)."""

import pytest
import torch

from flowrl.policies import DiffusionPolicy
from flowrl.policies.sde import ddim_step, sde_step

from ..conftest import TEXT


PROMPTS = ["a cat", "a dog", "a cat", "a red car", "a tree"]


def _policy(pipe, **kwargs):
    text = {} if type(pipe).__name__ == "StableDiffusionPipeline" else TEXT
    return DiffusionPolicy.from_pipeline(pipe, **text, **kwargs)


@pytest.mark.parametrize(
    "fixture, sampler, guidance, noise",
    [("sd3_pipe", "flow_sde", 4.5, 0.7), ("flux_pipe", "flow_sde", 3.5, 0.9), ("unet_pipe", "ddim", 5.0, 1.0)],
)
def test_shuffled_transitions_of_several_rollouts_rescore_exactly(request, fixture, sampler, guidance, noise):
    policy = _policy(request.getfixturevalue(fixture), forward_batch_size=2)
    kwargs = dict(num_steps=3, guidance_scale=guidance, sampler=sampler, noise_level=noise, height=64, width=64)
    first = policy.rollout(PROMPTS[:4], generator=torch.Generator().manual_seed(0), **kwargs)
    second = policy.rollout(PROMPTS[2:], generator=torch.Generator().manual_seed(1), **kwargs)
    # a buffer: every (sample, step) of both rollouts, shuffled, 7 rows (chunks of 2 with padding)
    states, nexts, steps, logps, prompts = [], [], [], [], []
    for rollout in (first, second):
        for i in range(len(rollout)):
            for t in range(3):
                states.append(rollout.latents[i, t])
                nexts.append(rollout.latents[i, t + 1])
                steps.append(t)
                logps.append(rollout.log_probs[i, t])
                prompts.append(rollout.prompts[i])
    order = torch.randperm(len(steps), generator=torch.Generator().manual_seed(2))[:7]
    states, nexts = torch.stack(states)[order], torch.stack(nexts)[order]
    steps, logps = torch.tensor(steps)[order], torch.stack(logps)[order]
    cond = policy.encode([prompts[i] for i in order.tolist()])
    out = policy.score_transitions(first, states, nexts, steps, cond)  # either rollout supplies the settings
    assert out.log_prob.shape == (7,) and out.mean.shape == states.shape and out.std.shape == (7,)
    assert torch.equal(out.log_prob, logps)  # bit for bit: the ratio of a fresh transition is exactly 1
    assert torch.equal(out.prev_sample, nexts)
    # `score` is the same computation on a rollout's own rows
    assert torch.equal(policy.score(second, 1).log_prob[:, 0], second.log_probs[:, 1])


def test_prediction_is_the_guided_network_output_behind_the_mean(sd3_pipe, unet_pipe):
    for pipe, sampler, noise in ((sd3_pipe, "flow_sde", 0.7), (unet_pipe, "ddim", 1.0)):
        policy = _policy(pipe, forward_batch_size=2)
        rollout = policy.rollout(
            PROMPTS[:3],
            num_steps=3,
            guidance_scale=4.0,
            sampler=sampler,
            noise_level=noise,
            generator=torch.Generator().manual_seed(3),
            height=64,
            width=64,
        )
        step = torch.tensor([0, 2, 1])
        rows = torch.arange(3)
        cond = policy.encode(rollout.prompts)
        states, nexts = rollout.latents[rows, step], rollout.latents[rows, step + 1]
        out, prediction = policy.score_transitions(rollout, states, nexts, step, cond, return_prediction=True)
        assert prediction.shape == states.shape
        # the step kernel applied to the returned prediction gives the same mean and log-prob
        if sampler == "ddim":
            again = ddim_step(
                policy.adapter.scheduler, prediction, rollout.timesteps[step], states, eta=noise, prev_sample=nexts
            )
        else:
            s = rollout.sigmas
            again = sde_step(
                sampler, prediction, s[step], s[step + 1], states, prev_sample=nexts, noise_level=noise, sigma_max=s[1]
            )
        torch.testing.assert_close(again.mean, out.mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(again.log_prob, out.log_prob, rtol=1e-5, atol=1e-5)
        # it is the CFG combination `uncond + g (text - uncond)` of the network's two branches
        t = rollout.timesteps[step]
        with torch.no_grad():
            text = policy.adapter.forward(states, t, cond, 4.0, static=rollout.static)
            uncond = policy.adapter.forward(states, t, policy.encode([""] * 3), 4.0, static=rollout.static)
        torch.testing.assert_close(prediction, uncond + 4.0 * (text - uncond), rtol=1e-4, atol=1e-5)


def test_bad_transitions_are_refused(sd3_pipe):
    policy = _policy(sd3_pipe)
    rollout = policy.rollout(
        PROMPTS[:2], num_steps=3, sde_window=(0, 2), generator=torch.Generator().manual_seed(4), height=64, width=64
    )
    states, nexts = rollout.latents[:, 2], rollout.latents[:, 3]
    cond = policy.encode(rollout.prompts)
    with pytest.raises(ValueError, match=r"steps \[2\] were sampled deterministically"):
        policy.score_transitions(rollout, states, nexts, 2, cond)
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\)"):
        policy.score_transitions(rollout, states, nexts, torch.tensor([0, 5]), cond)
    with pytest.raises(ValueError, match="one entry per state"):
        policy.score_transitions(rollout, states, nexts[:1], torch.tensor([0, 1]), cond)
