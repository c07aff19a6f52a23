"""Control policies and the value network: a Gaussian MLP (PPO's baseline) and a flow policy (FPO, DPPO-style).

Every policy acts in the environment's units; actions are stored unclipped and clipped to the action box only
for `env.step` (SB3's convention). `ActorCritic` holds the policy and the value network, trained by one
optimizer on `policy loss + vf_coef * value loss` with one gradient-norm clip (SB3's and CleanRL's PPO).

The flow policy is `flowrl.policies.flow_mlp.FlowMLPPolicy`, a velocity field `v(a_tau, tau | obs)` with
`a_tau = (1 - tau) a + tau eps` (tau = 1 is noise). It acts two ways:

- `ode`: Euler integration from noise to tau = 0 (FPO; its likelihood is never needed);
- `sde`: the same schedule through a stochastic kernel of `flowrl.policies.sde` (`dance_sde`: constant
  diffusion, step std `eta sqrt(|dt|)`, the marginal-preserving drift), so each of the K denoising steps is a
  Gaussian transition with a log-probability: the denoising MDP of DPPO (Ren et al. 2024, arXiv:2409.00588
  sec. 4.1) and of FPO's DPPO baseline. The chain of states is stored and re-scored, `[B, K]` per action.

DPPO's numerical guards apply to any kernel (`DPPOGuards`; DPPO's code, `model/diffusion/diffusion_vpg.py` and
`diffusion_ppo.py`): the step std floored at `min_std` when sampling and scoring (its `min_sampling_denoising_std` /
`min_logprob_denoising_std`, 0.1), the standard normal draw clipped to `+-noise_clip` (`randn_clip_value`, 3), and
each element's log-density clamped to `log_prob_clamp` (`[-5, 2]`) before the reduction over action dimensions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flowrl.policies.flow_mlp import FlowMLPPolicy
from flowrl.policies.sde import sde_step


_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "silu": nn.SiLU}


class DPPOGuards(nn.Module):
    """DPPO's guards on a Gaussian denoising step (see the module docstring); None turns one off."""

    def __init__(
        self,
        min_std: float | None = None,
        noise_clip: float | None = None,
        log_prob_clamp: tuple[float, float] | None = None,
        reduce: str = "mean",
    ):
        super().__init__()
        self.min_std, self.noise_clip, self.reduce = min_std, noise_clip, reduce
        self.log_prob_clamp = tuple(log_prob_clamp) if log_prob_clamp is not None else None

    @property
    def active(self) -> bool:
        return any(g is not None for g in (self.min_std, self.noise_clip, self.log_prob_clamp))

    def std(self, std: torch.Tensor) -> torch.Tensor:
        """`[B, 1]` the step std, floored at `min_std`."""
        std = std.reshape(-1, 1)
        return std.clamp_min(self.min_std) if self.min_std is not None else std

    def sample(self, mean: torch.Tensor, std: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """`mean + max(std, min_std) clip(z, +-noise_clip)` `[B, A]`."""
        if self.noise_clip is not None:
            noise = noise.clamp(-self.noise_clip, self.noise_clip)
        return mean + self.std(std) * noise

    def log_prob(self, x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """`[B]`: the Gaussian log-density of `x_next` per element, clamped, reduced over action dimensions."""
        std = self.std(std)
        per_element = -0.5 * ((x_next.float() - mean) / std).square() - std.log() - _HALF_LOG_2PI  # [B, A]
        if self.log_prob_clamp is not None:  # DPPO: a near-deterministic step cannot dominate the ratio
            per_element = per_element.clamp(*self.log_prob_clamp)
        return per_element.mean(-1) if self.reduce == "mean" else per_element.sum(-1)


def mlp(sizes: list[int], activation: str = "tanh", *, ortho: bool = False, out_gain: float = 1.0) -> nn.Sequential:
    """Linear layers of `sizes` with `activation` between them; `ortho`: orthogonal init, gain sqrt(2) for
    hidden layers and `out_gain` for the last, zero biases (SB3's and CleanRL's `ortho_init`)."""
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(a, b)
        if ortho:
            last = i == len(sizes) - 2
            nn.init.orthogonal_(linear.weight, gain=out_gain if last else math.sqrt(2))
            nn.init.zeros_(linear.bias)
        layers.append(linear)
        if i < len(sizes) - 2:
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class GaussianPolicy(nn.Module):
    """`N(mu(obs), diag(exp(log_std))^2)` with a state-independent log-std (SB3 / CleanRL continuous PPO).

    Log-probabilities and entropies are summed over action dimensions (the true density).
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        *,
        hidden: int = 64,
        depth: int = 2,
        activation: str = "tanh",
        log_std_init: float = 0.0,
        ortho_init: bool = True,
    ):
        super().__init__()
        self.act_dim = act_dim
        self.mean = mlp([obs_dim, *[hidden] * depth, act_dim], activation, ortho=ortho_init, out_gain=0.01)
        self.log_std = nn.Parameter(torch.full((act_dim,), float(log_std_init)))

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """`[N]` log-density of `actions [N, A]`: `sum_d -(a - mu)^2 / (2 s^2) - log s - log(2 pi) / 2`."""
        z = (actions.to(torch.float32) - self.mean(obs)) * torch.exp(-self.log_std)  # [N, A]
        return (-0.5 * z.square() - self.log_std - _HALF_LOG_2PI).sum(-1)

    def entropy(self, obs: torch.Tensor) -> torch.Tensor:
        """`[N]` entropy `sum_d log s + (1 + log(2 pi)) / 2` (state-independent, repeated per row)."""
        return (self.log_std + 0.5 + _HALF_LOG_2PI).sum().expand(obs.shape[0])

    @torch.no_grad()
    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False):
        """Actions `[N, A]`: the mean, or a draw."""
        mean = self.mean(obs)
        if deterministic:
            return mean
        noise = torch.randn(mean.shape, generator=generator, device=mean.device)
        return mean + self.log_std.exp() * noise


class FlowPolicy(nn.Module):
    """A flow-matching policy: `FlowMLPPolicy`'s velocity field and its samplers (see the module docstring).

    Args:
        obs_dim (`int`), act_dim (`int`): sizes.
        hidden (`int`), depth (`int`), tau_dim (`int`): the velocity MLP (SiLU, sinusoidal tau embedding).
        num_steps (`int`, defaults to 10): Euler / denoising steps K (FPO: 10).
        sampler (`str`, defaults to `"dance_sde"`): the kernel of the `sde` mode (`dance_sde`, `flow_sde`).
        noise_level (`float`, defaults to 0.3): its noise (`dance_sde` eta: step std `eta sqrt(1 / K)`).
        reduce (`str`, defaults to `"mean"`): per-step log-density over action dimensions (`mean`: DPPO's
            code; `sum`: the density).
        min_std, noise_clip, log_prob_clamp: DPPO's guards on the `sde` kernel (`DPPOGuards`; None: off).
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        *,
        hidden: int = 64,
        depth: int = 3,
        tau_dim: int = 8,
        num_steps: int = 10,
        sampler: str = "dance_sde",
        noise_level: float = 0.3,
        reduce: str = "mean",
        min_std: float | None = None,
        noise_clip: float | None = None,
        log_prob_clamp: tuple[float, float] | None = None,
    ):
        super().__init__()
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        self.act_dim, self.num_steps = act_dim, num_steps
        self.sampler, self.noise_level, self.reduce = sampler, noise_level, reduce
        self.velocity = FlowMLPPolicy(obs_dim, act_dim, hidden=hidden, depth=depth, tau_dim=tau_dim)
        self.guards = DPPOGuards(min_std, noise_clip, log_prob_clamp, reduce)
        self.register_buffer("taus", torch.linspace(1.0, 0.0, num_steps + 1), persistent=False)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False):
        """Actions `[N, A]` by Euler integration from noise (from 0, the prior's mode, when `deterministic`:
        FPO++'s zero-sampling)."""
        noise = torch.zeros(obs.shape[0], self.act_dim, device=obs.device) if deterministic else None
        return self.velocity.sample(obs, num_steps=self.num_steps, generator=generator, noise=noise)

    @torch.no_grad()
    def chain(self, obs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The denoising chain `[N, K + 1, A]` through the `sde` kernel (state 0: the noise; state K: the action)."""
        n = obs.shape[0]
        x = torch.randn((n, self.act_dim), generator=generator, device=obs.device)
        states = [x]
        for k in range(self.num_steps):
            sigma, sigma_next = self.taus[k].expand(n), self.taus[k + 1].expand(n)
            v = self.velocity(x, sigma, obs)
            noise = torch.randn(x.shape, generator=generator, device=x.device)
            out = sde_step(
                self.sampler, v, sigma, sigma_next, x, noise_level=self.noise_level, noise=noise, reduce=self.reduce
            )
            x = self.guards.sample(out.mean, out.std, noise).to(x.dtype) if self.guards.active else out.prev_sample
            states.append(x)
        return torch.stack(states, dim=1)

    def step_log_probs(self, obs: torch.Tensor, chain: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Log-probabilities `[N, c]` of the stored transitions `chain[:, k] -> chain[:, k + 1]` for the steps
        `steps [N, c]`, in one network call over the `N * c` rows."""
        n, c = steps.shape
        rows = torch.arange(n, device=chain.device)[:, None].expand(n, c)
        x, x_next = chain[rows, steps].reshape(n * c, -1), chain[rows, steps + 1].reshape(n * c, -1)
        sigma, sigma_next = self.taus[steps].reshape(-1), self.taus[steps + 1].reshape(-1)
        v = self.velocity(x, sigma, obs.repeat_interleave(c, dim=0))
        out = sde_step(
            self.sampler, v, sigma, sigma_next, x, prev_sample=x_next, noise_level=self.noise_level, reduce=self.reduce
        )
        if self.guards.active:
            return self.guards.log_prob(x_next, out.mean, out.std).reshape(n, c)
        return out.log_prob.reshape(n, c)


class ActorCritic(nn.Module):
    """The policy and the value MLP `V(obs)`, trained together by one optimizer."""

    def __init__(
        self,
        actor: nn.Module,
        obs_dim: int,
        *,
        hidden: int = 64,
        depth: int = 2,
        activation: str = "tanh",
        ortho_init: bool = True,
    ):
        super().__init__()
        self.actor = actor
        self.critic = mlp([obs_dim, *[hidden] * depth, 1], activation, ortho=ortho_init, out_gain=1.0)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """`[N]` state values."""
        return self.critic(obs).squeeze(-1)
