"""FIND's initial-noise policy (Chen et al. 2024, arXiv:2407.19453): a Gaussian over the initial latent.

The diffusion sampler stays frozen; the policy is `pi(z_T | c) = N(mu(c), diag sigma(c)^2)` and the episode
has one step, so its log-probability is exact. Either a free `(mu, sigma)` per prompt (FIND's code:
`mu` starts at 0, `sigma` at 1, i.e. at the pretrained prior) or a prompt-conditioned network on a prompt
embedding whose last layer starts at zero (so it too starts at the prior).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flowrl.core.kl import diag_gaussian_kl
from flowrl.core.ratios import gaussian_log_prob
from flowrl.policies.rollout import Record, per_sample


@dataclass
class NoiseDraws(Record):
    """Initial latents drawn from a noise policy (FIND's actions), kept beside the rollout they started."""

    z: torch.Tensor = per_sample()
    """`[B, C, h, w]` fp32 initial latents `z_T` (the actions)."""
    condition: torch.Tensor = per_sample()
    """`[B]` prompt ids (per-prompt tables) or `[B, E]` prompt embeddings: the noise policy's input."""
    text: torch.Tensor = per_sample()
    """`[B, E]` pooled prompt embeddings (what a calibration network sees)."""
    log_probs: torch.Tensor = per_sample()
    """`[B]` fp32 log-density of `z` under the behaviour policy (the ratio's denominator)."""


class InitialNoisePolicy(nn.Module):
    """A Gaussian policy over initial latents `[C, h, w]`.

    Args:
        latent_shape (`tuple`): `(C, h, w)`.
        num_prompts (`int`, *optional*): free parameters per prompt id (FIND's parameterisation).
        embed_dim (`int`, *optional*): instead, a prompt-conditioned MLP on `[B, embed_dim]` embeddings.
        hidden (`int`, defaults to 256): MLP width.
        min_std (`float`, defaults to 1e-4): floor of sigma (FIND clamps after every step).
        reduce (`str`, defaults to `"mean"`): log-prob reduction over latent elements, as the step kernels.
    """

    def __init__(
        self,
        latent_shape,
        *,
        num_prompts: int | None = None,
        embed_dim: int | None = None,
        hidden: int = 256,
        min_std: float = 1e-4,
        reduce: str = "mean",
    ):
        super().__init__()
        if (num_prompts is None) == (embed_dim is None):
            raise ValueError("pass exactly one of num_prompts (per-prompt tables) or embed_dim (conditioned MLP)")
        self.latent_shape = tuple(latent_shape)
        self.min_std, self.reduce = min_std, reduce
        numel = int(torch.tensor(self.latent_shape).prod())
        if num_prompts is not None:
            self.mean = nn.Parameter(torch.zeros(num_prompts, *self.latent_shape))
            self.std = nn.Parameter(torch.ones(num_prompts, *self.latent_shape))
            self.net = None
        else:
            last = nn.Linear(hidden, 2 * numel)
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)  # output 0: mean 0 and log-std 0, the N(0, I) prior
            self.net = nn.Sequential(
                nn.Linear(embed_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), last
            )

    def params(self, condition: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(mean, std)`, each `[B, C, h, w]`, for prompt ids `[B]` or embeddings `[B, embed_dim]`."""
        if self.net is None:
            mean, std = self.mean[condition], self.std[condition]
        else:
            out = self.net(condition).reshape(condition.shape[0], 2, *self.latent_shape)
            mean, std = out[:, 0], out[:, 1].exp()
        # clamp: a collapsed sigma would make the density (and the ratio) explode
        return mean, std.clamp_min(self.min_std)

    @torch.no_grad()
    def sample(self, condition: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Initial latents `z = mu + sigma eps` `[B, C, h, w]` (no gradient)."""
        mean, std = self.params(condition)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return mean + std * noise

    def log_prob(self, z: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        """`[B]` log-density of `z` (reduced over elements with `reduce`), differentiable in the parameters."""
        mean, std = self.params(condition)
        return gaussian_log_prob(z, mean, std, reduce=self.reduce)

    def kl_to_prior(self, condition: torch.Tensor) -> torch.Tensor:
        """`[B]` exact `KL(pi || N(0, I))`, reduced over elements."""
        mean, std = self.params(condition)
        return diag_gaussian_kl(mean, std, reduce=self.reduce)

    def proximity(self, condition: torch.Tensor) -> torch.Tensor:
        """`[B]` FIND's released regulariser `mean(mu^2 + (sigma - 1)^2)`, a parameter-space proxy of the KL."""
        mean, std = self.params(condition)
        return (mean**2 + (std - 1) ** 2).flatten(1).mean(-1)

    @torch.no_grad()
    def clamp_std_(self) -> None:
        """Project the free sigma table back to `>= min_std` (FIND does this after every optimiser step)."""
        if self.net is None:
            self.std.clamp_(min=self.min_std)
