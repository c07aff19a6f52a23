"""The control policies' configs: the flow policy (FPO, DPPO, BC) and the Gaussian policy (PPO, BC)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from flowrl.control.policies import FlowPolicy, GaussianPolicy


@dataclasses.dataclass
class FlowPolicyConfig:
    """The flow policy's velocity MLP and sampler."""

    hidden: int = 64
    """Hidden width."""
    depth: int = 3
    """Hidden layers (SiLU)."""
    tau_dim: int = 8
    """Size of the sinusoidal flow-time embedding (FPO: 8)."""
    num_steps: int = 10
    """Euler (denoising) steps per action (FPO: 10; FPO++ locomotion: 64)."""
    sampler: Literal["dance_sde", "flow_sde"] = "dance_sde"
    """Stochastic kernel of the denoising-MDP mode (`dppo`): `dance_sde` has constant diffusion `eta`, step std
    `eta sqrt(1 / num_steps)`; `flow_sde` is Flow-GRPO's."""
    noise_level: float = 0.3
    """The kernel's noise (`dance_sde` eta 0.3: step std 0.095 at 10 steps, DPPO's exploration floor 0.1)."""
    reduce: Literal["mean", "sum"] = "mean"
    """Per-step log-density over action dimensions: `mean` (DPPO's code) or `sum` (the density)."""
    min_std: float | None = None
    """`dppo`: floor of the denoising step's std when sampling and scoring (DPPO's code: 0.1, the `dppo` default;
    None: the kernel's own std)."""
    noise_clip: float | None = None
    """`dppo`: clip of the step's standard normal draw (DPPO's `randn_clip_value` 3; None: none)."""
    log_prob_clamp: tuple[float, float] | None = None
    """`dppo`: clamp of each action element's step log-density before the reduction (DPPO's code: [-5, 2])."""

    def build(self, obs_dim: int, act_dim: int) -> FlowPolicy:
        return FlowPolicy(
            obs_dim,
            act_dim,
            hidden=self.hidden,
            depth=self.depth,
            tau_dim=self.tau_dim,
            num_steps=self.num_steps,
            sampler=self.sampler,
            noise_level=self.noise_level,
            reduce=self.reduce,
            min_std=self.min_std,
            noise_clip=self.noise_clip,
            log_prob_clamp=self.log_prob_clamp,
        )


@dataclasses.dataclass
class GaussianPolicyConfig:
    """The Gaussian policy's mean MLP and log-std."""

    hidden: int = 64
    """Hidden width (SB3: 64)."""
    depth: int = 2
    """Hidden layers (SB3: 2)."""
    activation: Literal["tanh", "relu", "silu"] = "tanh"
    """Activation (SB3: tanh)."""
    log_std_init: float = 0.0
    """Initial log-std of every action dimension (state-independent, trained)."""
    ortho_init: bool = True
    """Orthogonal init (gain sqrt(2), 0.01 for the action head)."""

    def build(self, obs_dim: int, act_dim: int) -> GaussianPolicy:
        return GaussianPolicy(
            obs_dim,
            act_dim,
            hidden=self.hidden,
            depth=self.depth,
            activation=self.activation,
            log_std_init=self.log_std_init,
            ortho_init=self.ortho_init,
        )
