from dataclasses import replace

import pytest
import torch

from flowrl.core import compute_policy_loss, ratio_norm_grpo_guard
from flowrl.models import load_pipeline, tiny_sd3
from flowrl.policies import DiffusionPolicy

from ..conftest import TEXT


PROMPTS = ["a cat", "a dog", "a cat", "a red car"]


def _policy(pipe, **kwargs):
    text = {} if type(pipe).__name__ == "StableDiffusionPipeline" else TEXT
    return DiffusionPolicy.from_pipeline(pipe, **text, **kwargs), text


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# every family's ODE rollout against its diffusers pipeline and its LoRA round trip: tests/models/test_families.py


CASES = [
    ("sd3_pipe", "flow_sde", 4.5, 0.7),
    ("sd3_pipe", "flow_sde", 1.0, 0.7),
    ("sd3_pipe", "dance_sde", 4.5, 0.3),
    ("sd3_pipe", "cps", 1.0, 0.8),
    ("sd3_pipe", "cps_gaussian", 1.0, 0.8),
    ("flux_pipe", "flow_sde", 3.5, 0.9),
    ("unet_pipe", "ddim", 5.0, 1.0),
    ("unet_pipe", "ddim", 1.0, 1.0),
]


@pytest.mark.parametrize("fixture, sampler, guidance, noise", CASES)
def test_rescoring_reproduces_rollout_log_probs_exactly(request, fixture, sampler, guidance, noise):
    policy, _ = _policy(request.getfixturevalue(fixture))
    rollout = policy.rollout(
        PROMPTS,
        num_steps=4,
        guidance_scale=guidance,
        sampler=sampler,
        noise_level=noise,
        generator=_gen(1),
        height=64,
        width=64,
    )
    steps = rollout.sde_steps
    assert len(steps) >= 3  # (CPS's last step is deterministic)
    logp = policy.log_prob(rollout, steps.expand(4, -1))
    assert torch.equal(logp, rollout.log_probs[:, steps])  # ratio exactly 1
    # one sample at a time, and a random step per sample: still exact
    single = rollout.select([3])
    assert torch.equal(policy.log_prob(single, steps.expand(1, -1)), single.log_probs[:, steps])
    per_sample = steps[torch.tensor([2, 0, 1, 0]) % len(steps)]
    assert torch.equal(policy.log_prob(rollout, per_sample)[:, 0], rollout.log_probs[torch.arange(4), per_sample])


def test_forward_batch_size_pads_and_stays_exact(sd3_pipe):
    policy, _ = _policy(sd3_pipe, forward_batch_size=2)
    prompts = PROMPTS + ["a tree"]  # 5 samples: chunks of 2, 2, 1 (+1 padding)
    rollout = policy.rollout(prompts, num_steps=3, generator=_gen(2), height=64, width=64)
    assert rollout.forward_batch_size == 2
    for rows in ([4], [0, 4, 2], [1, 3]):
        sub = rollout.select(rows)
        assert torch.equal(policy.log_prob(sub, 1), sub.log_probs[:, 1:2])


def test_rollouts_sampled_in_parts_concatenate_and_rescore_exactly(sd3_pipe):
    from flowrl.policies import DiffusionRollout, Rollout
    from flowrl.policies.fpo import FPODraws

    policy, _ = _policy(sd3_pipe, forward_batch_size=2)
    kwargs = dict(num_steps=3, guidance_scale=4.5, height=64, width=64, store_means=True)
    a = policy.rollout(PROMPTS[:3], generator=_gen(3), **kwargs)  # cat, dog, cat
    b = policy.rollout(["a red car", "a cat"], generator=_gen(4), **kwargs)
    assert isinstance(a, Rollout)  # the protocol every modality's rollout implements
    draws = lambda n, v: FPODraws(taus=torch.full((n, 2), v), noises=torch.full((n, 2, 3), v))  # noqa: E731
    a, b = replace(a, draws=draws(3, 0.0)), replace(b, draws=draws(2, 1.0))
    both = DiffusionRollout.cat([a, b])
    assert both.prompts == PROMPTS[:3] + ["a red car", "a cat"]
    assert both.unique_prompts == ["a cat", "a dog", "a red car"] and both.prompt_ids.tolist() == [0, 1, 0, 2, 0]
    assert torch.equal(both.group_ids, both.prompt_ids) and both.mask.shape == (5, 3)
    assert torch.equal(both.cond["prompt_embeds"][2], b.cond["prompt_embeds"][0])
    assert torch.equal(both.latents, torch.cat([a.latents, b.latents]))
    assert both.means.shape[0] == 5 and both.draws.taus[:, 0].tolist() == [0, 0, 0, 1, 1]
    assert both.select([4, 0]).draws.taus[:, 0].tolist() == [1, 0]  # typed draws follow the rows
    steps = both.sde_steps
    assert torch.equal(policy.log_prob(both, steps.expand(5, -1)), both.log_probs[:, steps])
    with pytest.raises(ValueError, match="different guidance_scale"):
        DiffusionRollout.cat([a, policy.rollout(["a cat"], generator=_gen(5), **{**kwargs, "guidance_scale": 1.0})])
    with pytest.raises(ValueError, match="draws: cannot concatenate parts where only some have the field"):
        DiffusionRollout.cat([a, policy.rollout(["a cat"], generator=_gen(5), **kwargs)])
    # the tensor state round-trips (a checkpointable record)
    plain, tensors = both.state_dict()
    again = DiffusionRollout.from_state_dict(plain, tensors)
    assert again.prompts == both.prompts and again.sampler == both.sampler and again.height == both.height
    assert torch.equal(again.latents, both.latents) and torch.equal(again.draws.noises, both.draws.noises)
    assert (
        torch.equal(again.cond["prompt_embeds"], both.cond["prompt_embeds"])
        and again.null_cond.keys() == both.null_cond.keys()
    )
    assert torch.equal(policy.log_prob(again, steps.expand(5, -1)), both.log_probs[:, steps])


def test_rollout_record(sd3_pipe):
    policy, _ = _policy(sd3_pipe)
    rollout = policy.rollout(
        PROMPTS, num_steps=5, generator=_gen(), height=64, width=64, sde_window=(1, 3), store_means=True
    )
    assert rollout.prompt_ids.tolist() == [0, 1, 0, 2]
    assert rollout.unique_prompts == ["a cat", "a dog", "a red car"]
    assert rollout.latents.shape == (4, 6, 16, 32, 32)
    assert rollout.log_probs.shape == (4, 5) and rollout.means.shape == (4, 5, 16, 32, 32)
    assert rollout.sde_mask.tolist() == [False, True, True, False, False]
    assert torch.all(rollout.log_probs[:, ~rollout.sde_mask] == 0)
    assert torch.all(rollout.log_probs[:, rollout.sde_mask] != 0)
    assert torch.all(rollout.stds[rollout.sde_mask] > 0) and torch.all(rollout.stds[~rollout.sde_mask] == 0)
    assert rollout.sigmas.shape == (6,) and rollout.sigmas[0] == 1 and rollout.sigmas[-1] == 0
    # deterministic steps outside the window: x' = x + dt v exactly, nothing to train
    with pytest.raises(ValueError, match=r"steps \[0\] were sampled deterministically"):
        policy.log_prob(rollout, 0)
    sub = rollout.select(torch.tensor([False, True, False, True]))
    assert sub.prompts == ["a dog", "a red car"] and sub.latents.shape[0] == 2


def test_same_seed_same_rollout_and_different_seed_differs(sd3_pipe):
    policy, _ = _policy(sd3_pipe)
    a = policy.rollout(PROMPTS[:2], num_steps=3, generator=_gen(5), height=64, width=64)
    b = policy.rollout(PROMPTS[:2], num_steps=3, generator=_gen(5), height=64, width=64)
    c = policy.rollout(PROMPTS[:2], num_steps=3, generator=_gen(6), height=64, width=64)
    assert torch.equal(a.latents, b.latents) and not torch.equal(a.latents, c.latents)


def test_grpo_guard_quantities_from_a_rollout(sd3_pipe):
    # the stored behaviour means and the re-scored means give the RatioNorm-ed log-ratio; at unchanged
    # weights it is exactly 0, and the grpo_guard objective sees ratio 1
    policy, _ = _policy(sd3_pipe)
    rollout = policy.rollout(PROMPTS, num_steps=3, generator=_gen(3), height=64, width=64, store_means=True)
    out = policy.score(rollout, 1)
    assert torch.equal(out.mean[:, 0], rollout.means[:, 1])
    normed = ratio_norm_grpo_guard(rollout.latents[:, 2], out.mean[:, 0], rollout.means[:, 1], out.std[:, 0])
    assert torch.all(normed == 0)
    mean_diff_sq = (out.mean - rollout.means[:, 1:2]).pow(2).flatten(2).mean(-1)
    loss, metrics = compute_policy_loss(
        "grpo_guard", out.log_prob, rollout.log_probs[:, 1:2], torch.ones(4), std=out.std, mean_diff_sq=mean_diff_sq
    )
    assert metrics["ratio_mean"].item() == 1.0


def test_gradients_flow_from_log_probs_to_the_network():
    pipe = tiny_sd3(seed=3)
    policy, _ = _policy(pipe)
    rollout = policy.rollout(PROMPTS[:2], num_steps=3, generator=_gen(), height=64, width=64)
    loss, _ = compute_policy_loss(
        "ppo", policy.log_prob(rollout, 1), rollout.log_probs[:, 1:2], torch.tensor([1.0, -1.0]), clip_eps_low=1e-4
    )
    loss.backward()
    grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


def test_text_embeddings_are_computed_once_per_prompt(sd3_pipe, monkeypatch):
    policy, _ = _policy(sd3_pipe)
    calls = []
    encode = policy.adapter.encode
    monkeypatch.setattr(policy.adapter, "encode", lambda prompts: calls.append(list(prompts)) or encode(prompts))
    policy.rollout(PROMPTS, num_steps=2, generator=_gen(), height=64, width=64)
    policy.rollout(PROMPTS, num_steps=2, generator=_gen(), height=64, width=64)
    # one text-encoder call for the three prompts and the negative prompt, padded to a fixed batch
    assert len(calls) == 1 and sorted(set(calls[0])) == ["", "a cat", "a dog", "a red car"]


def test_reference_policy_is_the_base_model(sd3_pipe):
    policy, _ = _policy(tiny_sd3(seed=4))
    policy.add_lora(rank=4)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    rollout = policy.rollout(PROMPTS[:2], num_steps=3, generator=_gen(), height=64, width=64)
    base = DiffusionPolicy.from_pipeline(tiny_sd3(seed=4), **TEXT)
    ref_logp = policy.log_prob(rollout, 1, reference=True)
    assert torch.equal(ref_logp, base.log_prob(rollout, 1))
    assert not ref_logp.requires_grad
    assert not torch.equal(ref_logp, policy.log_prob(rollout, 1))
    assert policy.model.peft_config  # adapters re-enabled afterwards
    torch.testing.assert_close(policy.log_prob(rollout, 1), rollout.log_probs[:, 1:2], rtol=0, atol=0)
    full = DiffusionPolicy.from_pipeline(tiny_sd3(seed=4), **TEXT)
    with pytest.raises(ValueError, match="no reference policy"):
        full.log_prob(rollout, 1, reference=True)
    full.freeze_reference()
    with torch.no_grad():
        next(full.model.parameters()).add_(1.0)
    assert torch.equal(full.log_prob(rollout, 1, reference=True), ref_logp)


def test_loaders(tmp_path, sd3_pipe):
    sd3_pipe.save_pretrained(tmp_path / "sd3")
    pipe = load_pipeline(tmp_path / "sd3")
    assert type(pipe).__name__ == "StableDiffusion3Pipeline" and not pipe.transformer.training
    policy = DiffusionPolicy.from_pretrained(str(tmp_path / "sd3"), max_sequence_length=16)
    a = policy.rollout(["a cat"], num_steps=2, sampler="ode", generator=_gen(), height=64, width=64)
    b, _ = _policy(sd3_pipe)
    b = b.rollout(["a cat"], num_steps=2, sampler="ode", generator=_gen(), height=64, width=64)
    torch.testing.assert_close(a.images, b.images, rtol=0, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="model folder .*/nope does not exist"):
        load_pipeline(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        load_pipeline(tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown model family 'sd9'"):
        load_pipeline(tmp_path / "sd3", family="sd9")


def test_hub_id_offline_gives_a_clear_error():
    with pytest.raises(OSError, match="could not load 'nobody/no-such-model'.*local-dir"):
        load_pipeline("nobody/no-such-model")


def test_bad_arguments(sd3_pipe, unet_pipe):
    policy, _ = _policy(sd3_pipe)
    with pytest.raises(ValueError, match="sampler 'ddim' does not fit a sd3 model"):
        policy.rollout(["a cat"], num_steps=2, sampler="ddim")
    with pytest.raises(ValueError, match="sde_window"):
        policy.rollout(["a cat"], num_steps=2, sde_window=(1, 5))
    with pytest.raises(ValueError, match="at least one prompt"):
        policy.rollout([], num_steps=2)
    rollout = policy.rollout(["a cat", "a dog"], num_steps=2, generator=_gen(), height=64, width=64)
    with pytest.raises(ValueError, match=r"step indices must lie in \[0, 2\)"):
        policy.log_prob(rollout, 2)
    with pytest.raises(ValueError, match="B=2"):
        policy.log_prob(rollout, torch.zeros(3, 1, dtype=torch.long))
    unet, _ = _policy(unet_pipe)
    with pytest.raises(ValueError, match="does not fit a unet model"):
        unet.rollout(["a cat"], num_steps=2, sampler="flow_sde")


def _random_callable_policy():
    """A random SD3-convention velocity network with callable text encoder and decoder (the digits world's shape)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from flowrl.policies import from_callable

    torch.manual_seed(0)
    net = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=1,
        out_channels=1,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=6,
        caption_projection_dim=16,
        pooled_projection_dim=6,
        pos_embed_max_size=8,
    )
    table = {"zero": torch.randn(6), "one": torch.randn(6), "": torch.zeros(6)}  # "" is the CFG negative

    def encode(prompts):
        pooled = torch.stack([table[p] for p in prompts])
        return {"prompt_embeds": pooled[:, None, :], "pooled": pooled}

    def decode(latents):
        return ((latents.clamp(-1, 1) + 1) / 2).expand(-1, 3, -1, -1)

    return from_callable(net, encode, decode, (1, 8, 8), FlowMatchEulerDiscreteScheduler(shift=1.0))


def test_callable_adapter_policy():
    policy = _random_callable_policy()
    rollout = policy.rollout(["zero", "one", "zero"], num_steps=4, guidance_scale=2.0, generator=_gen())
    assert rollout.images.shape == (3, 3, 8, 8) and rollout.latents.shape == (3, 5, 1, 8, 8)
    # the same batch layout re-scores bit for bit; another layout (one row alone: a different GEMM shape) may
    # differ in the last bits on some CPUs (MKL/AVX2 kernels pick by shape), so it is compared with a tolerance
    assert torch.equal(policy.log_prob(rollout, 1), rollout.log_probs[:, 1:2])
    torch.testing.assert_close(
        policy.log_prob(rollout.select([1]), 2), rollout.log_probs[1:2, 2:3], rtol=1e-5, atol=1e-6
    )
    policy.log_prob(rollout, 0).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.model.parameters())


@pytest.mark.parametrize("fixture", ["sd3_pipe", "flux_pipe"])
def test_dpm_solver_after_the_window(request, fixture):
    # MixGRPO-Flash: the window's transitions are those of the Euler-after-window rollout (same noise), the grid
    # after it is shorter, decreasing and ends at 0, and the stored transitions re-score exactly
    policy, _ = _policy(request.getfixturevalue(fixture))
    kwargs = dict(num_steps=10, sde_window=(1, 3), guidance_scale=1.0, height=64, width=64)
    euler = policy.rollout(PROMPTS, generator=_gen(), **kwargs)
    flash = policy.rollout(
        PROMPTS, generator=_gen(), post_window_solver="dpm_solver_2m", post_window_ratio=0.4, **kwargs
    )
    assert flash.num_steps == 3 + max(int((10 - 3 + 1) * 0.4), 2) - 1 == 5
    assert torch.equal(flash.sigmas[:4], euler.sigmas[:4]) and flash.sigmas[-1] == 0
    assert (flash.sigmas.diff() < 0).all() and flash.sde_mask.tolist() == [False, True, True, False, False]
    assert torch.equal(flash.latents[:, :4], euler.latents[:, :4])
    assert torch.equal(flash.log_probs[:, :3], euler.log_probs[:, :3])
    assert torch.equal(policy.log_prob(flash, torch.tensor([[1, 2]] * len(PROMPTS))), flash.log_probs[:, 1:3])
    assert flash.images.shape == euler.images.shape
    # a window reaching the last step leaves nothing to re-discretise
    whole = policy.rollout(
        PROMPTS[:1],
        num_steps=4,
        sde_window=(0, 4),
        post_window_solver="dpm_solver_2m",
        generator=_gen(),
        height=64,
        width=64,
    )
    assert whole.num_steps == 4
    with pytest.raises(ValueError, match="post_window_solver must be one of euler, dpm_solver_2m"):
        policy.rollout(PROMPTS[:1], num_steps=4, post_window_solver="heun")


def test_resampled_sigmas_are_uniform_in_unshifted_time(flux_pipe, sd3_pipe):
    # Flux's pipeline schedules linspace(1, 1/T, T) shifted by e^mu, so re-discretising the tail with as many
    # steps as it had reproduces the schedule; SD3's static shift 3 inverts likewise
    policy, _ = _policy(flux_pipe)
    shape = policy.adapter.initial_latents(1, 64, 64, _gen()).shape
    _, sigmas = policy.adapter.schedule(10, shape)
    torch.testing.assert_close(policy.adapter.resample_sigmas(float(sigmas[4]), 6, shape), sigmas[4:])
    sd3, _ = _policy(sd3_pipe)
    t = torch.tensor([0.75, 0.5, 0.25, 0.0])
    shifted = 3 * t / (1 + 2 * t)
    torch.testing.assert_close(sd3.adapter.resample_sigmas(float(shifted[0]), 3, (1, 4, 8, 8)), shifted)


class _GaussianFlow(torch.nn.Module):
    """The exact velocity of data N(mu, s^2 I): `x_t = (1 - t) mu + m(t) z`, `m(t) = sqrt((1 - t)^2 s^2 + t^2)`,
    so the ODE carries `z = x_1` to `x_0 = mu + s z`."""

    def __init__(self, mu: float = 0.5, s: float = 0.3):
        super().__init__()
        self.mu, self.s = mu, s
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # dtype and device for the adapter

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections):
        t = (timestep.to(torch.float64) / 1000).reshape(-1, 1, 1, 1)
        m = ((1 - t) ** 2 * self.s**2 + t**2).sqrt()
        z = (hidden_states.double() - (1 - t) * self.mu) / m
        return (-self.mu + (t - (1 - t) * self.s**2) / m * z).to(hidden_states.dtype)


def test_dpm_solver_after_the_window_is_second_order():
    # on the exact Gaussian flow, doubling the steps after a one-step window cuts DPM-Solver++(2M)'s error about
    # 4x and Euler's about 2x (the point of MixGRPO-Flash's higher-order solver)
    from diffusers import FlowMatchEulerDiscreteScheduler

    from flowrl.policies import from_callable

    def encode(prompts):
        return {"prompt_embeds": torch.zeros(len(prompts), 1, 2), "pooled": torch.zeros(len(prompts), 2)}

    flow = _GaussianFlow().double()
    policy = from_callable(flow, encode, lambda x: x, (1, 4, 4), FlowMatchEulerDiscreteScheduler(shift=3.0))
    noise = torch.randn(6, 1, 4, 4, generator=_gen(), dtype=torch.float64)
    exact = flow.mu + flow.s * noise

    def error(solver, steps):
        rollout = policy.rollout(
            ["x"] * 6,
            num_steps=steps,
            sampler="ode",
            latents=noise,
            sde_window=(0, 1),
            post_window_solver=solver,
            post_window_ratio=1.0,
            decode=False,
        )
        return (rollout.latents[:, -1] - exact).norm().item()

    # (from 32 steps on: its first-order last step jumps from the last re-discretised sigma straight to 0)
    assert 1.5 < error("euler", 32) / error("euler", 64) < 2.5
    assert error("dpm_solver_2m", 32) / error("dpm_solver_2m", 64) > 3.5
    assert error("dpm_solver_2m", 64) < error("euler", 64) / 5
