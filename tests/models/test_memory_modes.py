"""The memory and speed modes of a GPU run, each checked on the CPU where exactness is decided: the ratio stays exactly
1 at the old weights in every mode, and what a mode changes (the gradient of CFG's unconditional branch) is what its
docs say."""

from types import SimpleNamespace

import pytest
import torch

from flowrl.models import ModelConfig
from flowrl.models.families import MODEL_FAMILIES
from flowrl.policies import DiffusionPolicy
from flowrl.policies.build import enable_checkpointing, offloads_text, prepare_training, repeated_blocks
from flowrl.run.engine import fused_options


TEXT = {"max_sequence_length": 16}
ROLL = dict(num_steps=3, guidance_scale=3.0, noise_level=0.8, height=64, width=64)


def _policy(model=None, mixed_precision="no", **kwargs):
    policy = DiffusionPolicy.from_pipeline(MODEL_FAMILIES.get("sd3").tiny(seed=3), options=TEXT, **kwargs)
    config = ModelConfig(name="tiny", lora_rank=4, lora_alpha=8, **(model or {}))
    return prepare_training(policy, config, mixed_precision=mixed_precision)


def _rollout(policy, n=4, **kwargs):
    return policy.rollout(["a cat", "a dog"] * (n // 2), generator=torch.Generator().manual_seed(0), **ROLL, **kwargs)


def _rescored(policy, rollout):
    steps = rollout.sde_steps.expand(len(rollout), -1)
    with torch.no_grad():
        return policy.log_prob(rollout, steps), rollout.log_probs[:, rollout.sde_steps]


def _trained(policy, seed=1):
    """The adapter moved off its start (its B is zero at first, so nothing would differ)."""
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        for p in policy.trainable_parameters():
            p.normal_(std=0.05)
    return policy


def test_without_the_unconditional_gradient_the_ratio_stays_exactly_one_and_only_the_text_branch_learns():
    policy = _trained(_policy(forward_batch_size=2))
    policy.uncond_grad = False  # sampling.uncond_grad: false (the rollout splits its calls alike)
    rollout = _rollout(policy)
    new, old = _rescored(policy, rollout)
    assert torch.equal(new, old)
    # the gradient is the guided prediction's through the text branch alone, s * d(v_text): Flow-GRPO's detach
    both = _policy(forward_batch_size=2)
    both.model.load_state_dict(policy.model.state_dict())
    x, s = rollout.latents[:, 1], rollout.guidance_scale
    t = rollout.timesteps[1:2].expand(len(x))
    chunk = both._plan(len(x), len(x), rollout.sample_cond(), rollout.null_cond)[0].cond
    grads = []
    for p in (both, policy):
        p.model.zero_grad(set_to_none=True)
        p._predict(p.model, x, t, chunk, True, s, rollout.static).float().sum().backward()
        grads.append({n: q.grad.clone() for n, q in p.model.named_parameters() if q.grad is not None})
    both.model.zero_grad(set_to_none=True)
    text = {k: v[len(x) :] for k, v in chunk.items()}
    (s * both.adapter.forward(x, t, text, s).float().sum()).backward()
    expected = {n: q.grad for n, q in both.model.named_parameters() if q.grad is not None}
    assert expected and set(expected) == set(grads[1])
    for name, grad in expected.items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(not torch.allclose(grads[0][n], grads[1][n]) for n in expected)  # both branches: another gradient


def test_lora_without_input_casts_is_bit_identical_under_autocast_and_keeps_the_ratio():
    cast, plain = _policy(mixed_precision="no"), _policy(mixed_precision="bf16")
    layers = [m for m in plain.model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and not any(m.cast_input_dtype_enabled for m in layers)
    _trained(cast), _trained(plain)
    rollouts = []
    for p in (cast, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rollouts.append(_rollout(p))
            new, old = _rescored(p, rollouts[-1])
        assert torch.equal(new, old)
    assert torch.equal(rollouts[0].latents, rollouts[1].latents)  # autocast computes the adapter alike either way
    assert torch.equal(rollouts[0].log_probs, rollouts[1].log_probs)


def test_a_bf16_adapter_keeps_the_ratio_exactly_one():
    policy = _policy({"lora_dtype": "bf16"}, mixed_precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in policy.trainable_parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new, old = _rescored(policy, _rollout(policy))
    assert torch.equal(new, old)


def test_selective_checkpointing_recomputes_a_share_of_the_blocks_with_the_same_gradients():
    plain, half = _policy(), _policy({"gradient_checkpointing": 0.5})
    blocks = repeated_blocks(half.model)
    rollout = _rollout(plain)
    calls = []
    original = torch.utils.checkpoint.checkpoint

    def counting(fn, *args, **kwargs):
        calls.append(fn.__self__)
        return original(fn, *args, **kwargs)

    grads = []
    for policy in (plain, half):
        policy.model.zero_grad(set_to_none=True)
        torch.utils.checkpoint.checkpoint = counting
        try:
            logp = policy.log_prob(rollout, rollout.sde_steps.expand(len(rollout), -1))
        finally:
            torch.utils.checkpoint.checkpoint = original
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    chosen = {id(b) for b in calls}
    assert len(chosen) == round(0.5 * len(blocks)) and chosen < {id(b) for b in blocks}
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="gradient_checkpointing must be true, false or a fraction"):
        ModelConfig(gradient_checkpointing=1.5)
    enable_checkpointing(plain.model, True)
    assert plain.model.is_gradient_checkpointing


def test_rollouts_in_larger_calls_are_rescored_at_the_training_calls_size():
    # sampling.forward_batch_size: the rollout calls 4 rows, training 2; the stochastic steps' log-probs (and
    # GRPO-Guard's means) are re-scored in calls of 2, so a training forward reproduces them bit for bit
    policy = _policy(forward_batch_size=2)
    rollout = _rollout(policy, n=6, forward_batch_size=4, store_means=True)
    assert rollout.forward_batch_size == 4
    rescored = policy.rescore(rollout)
    assert rescored.forward_batch_size == 2 and torch.equal(rescored.latents, rollout.latents)
    new, old = _rescored(policy, rescored)
    assert torch.equal(new, old)
    out = policy.score(rescored, rescored.sde_steps.expand(6, -1))
    assert torch.equal(out.mean.to(rescored.means), rescored.means[:, rescored.sde_steps])
    assert policy.rescore(rescored) is rescored  # already at the size: nothing to do


def test_decoding_in_chunks_gives_the_whole_batch_s_images():
    policy = _policy()
    rollout = _rollout(policy, n=6, decode=False)
    x = rollout.latents[:, -1]
    torch.testing.assert_close(policy.decode(x, 64, 64, 4), policy.adapter.decode(x, 64, 64), rtol=0, atol=1e-6)


def test_text_encoders_are_offloaded_for_8b_networks_on_a_gpu():
    small = SimpleNamespace(model=torch.nn.Linear(4, 4))
    big = SimpleNamespace(model=SimpleNamespace(parameters=lambda: [torch.empty(1).expand(int(8e9))]))
    auto = ModelConfig()
    assert not offloads_text(auto, big, "cpu") and not offloads_text(auto, small, "cuda")
    assert offloads_text(auto, big, "cuda")
    assert offloads_text(ModelConfig(offload_text_encoders=True), small, "cpu")
    assert not offloads_text(ModelConfig(offload_text_encoders=False), big, "cuda")


def test_prompts_encode_on_the_device_before_the_network_moves_there():
    # FLUX.2-dev's network and text encoder do not fit one GPU together: the prompts are encoded with the encoders
    # on the device and the network still in CPU memory, then the network moves and the encoders stay behind (the
    # moves themselves: tests/test_gpu.py; here the device is the CPU and the plumbing is checked)
    from flowrl.policies.build import encode_then_offload

    policy = _policy()
    seen, moved = [], []
    encode = policy.adapter.encode
    policy.adapter.encode = lambda prompts: seen.append(policy.adapter.device) or encode(prompts)
    encode_then_offload(policy, "cpu", ["a cat", "a dog", "a cat"])  # what the run's loader calls
    assert policy.text_encoders_offloaded and policy.adapter.encode_device is None
    assert seen == [torch.device("cpu")] * 2  # the prompts once, the negative prompt once
    cond = policy.encode(["a cat", "a dog"])  # from the cache
    assert len(seen) == 2
    for name, module in policy.adapter.pipeline.components.items():
        if isinstance(module, torch.nn.Module):
            original = module.to
            module.to = lambda *a, _n=name, _o=original, **k: moved.append(_n) or _o(*a, **k)
    policy.to_device("cpu")
    assert "transformer" in moved and "vae" in moved and not any(n.startswith("text_encoder") for n in moved)
    assert torch.equal(policy.encode(["a cat", "a dog"])["prompt_embeds"], cond["prompt_embeds"])


def test_fused_adamw_is_chosen_for_cuda_parameters_outside_deepspeed():
    cuda = [SimpleNamespace(device=torch.device("cuda"))]
    cpu = [torch.nn.Parameter(torch.zeros(2))]
    assert fused_options(cuda, "none") == {"fused": True} == fused_options(cuda, "fsdp2")
    assert fused_options(cuda, "zero2") == {} == fused_options(cpu, "none") == fused_options(cuda, "none", "rmsprop")


@pytest.mark.slow  # inductor compiles the tiny network's blocks on the CPU: about a minute
def test_compiled_blocks_keep_the_ratio_within_the_tightest_clip_range():
    # model.compile: rollouts run the compiled inference graphs, the update the compiled training graphs; the
    # kernels may round differently, so the ratio at the old weights is measured against the clip ranges (on this
    # CPU it comes out exactly 1; on a GPU: benchmarks/gpu_bench.py --compile)
    policy = _trained(_policy({"compile": True}))
    rollout = _rollout(policy)
    logp = policy.log_prob(rollout, rollout.sde_steps.expand(len(rollout), -1))
    drift = (logp.detach() - rollout.log_probs[:, rollout.sde_steps]).abs().max()
    assert float(drift) <= 2e-6  # GRPO-Guard's clip range, the tightest a shipped recipe uses
