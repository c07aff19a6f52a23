"""A flow-matching policy for continuous control: an MLP velocity field over actions given observations.

`v(a_tau, tau | obs)` with the flowrl convention `a_tau = (1 - tau) a + tau eps` (tau = 1 is noise); actions are
sampled by Euler integration from tau = 1 to 0 (FPO uses 10 steps). Trained with FPO's ratio
(`flowrl.policies.fpo`), it needs no likelihood.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_embedding(tau: torch.Tensor, dim: int) -> torch.Tensor:
    """`[N, dim]` sin/cos features of `tau [N]` at geometric frequencies."""
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, device=tau.device, dtype=torch.float32) / max(half, 1))
    angles = 1000.0 * tau.to(torch.float32)[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class FlowMLPPolicy(nn.Module):
    """MLP velocity field `v(a_tau, tau, obs)`.

    Args:
        obs_dim (`int`), act_dim (`int`): observation and action sizes.
        hidden (`int`, defaults to 64), depth (`int`, defaults to 3): MLP size (FPO's actor: 4 x 32).
        tau_dim (`int`, defaults to 8): sinusoidal tau-embedding size (FPO uses 8).
    """

    def __init__(self, obs_dim: int, act_dim: int, *, hidden: int = 64, depth: int = 3, tau_dim: int = 8):
        super().__init__()
        self.obs_dim, self.act_dim, self.tau_dim = obs_dim, act_dim, tau_dim
        layers, width = [], obs_dim + act_dim + tau_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        layers.append(nn.Linear(width, act_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, actions: torch.Tensor, tau: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        """Velocity `[N, act_dim]` of noisy actions `[N, act_dim]` at noise levels `[N]` given `obs [N, obs_dim]`."""
        return self.net(torch.cat([actions, sinusoidal_embedding(tau, self.tau_dim), obs], dim=-1))

    @torch.no_grad()
    def sample(
        self,
        obs: torch.Tensor,
        *,
        num_steps: int = 10,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ):
        """Actions `[N, act_dim]` by Euler integration of the flow from noise (tau = 1) to tau = 0; `noise`: the
        starting point (default: drawn from N(0, I))."""
        a = torch.randn(obs.shape[0], self.act_dim, generator=generator, device=obs.device) if noise is None else noise
        taus = torch.linspace(1.0, 0.0, num_steps + 1, device=obs.device)
        for tau, tau_next in zip(taus[:-1], taus[1:]):
            a = a + (tau_next - tau) * self(a, tau.expand(obs.shape[0]), obs)
        return a

    def velocity_fn(self, obs: torch.Tensor, num_draws: int):
        """`velocity_fn` for `flowrl.policies.fpo` with observations repeated for each of the `num_draws` draws."""
        repeated = obs.repeat_interleave(num_draws, dim=0)
        return lambda x, tau: self(x, tau, repeated)
