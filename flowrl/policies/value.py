"""State-value networks `V(x_t, t, c)` over intermediate denoising states: DPOK's baseline, AC-Flow's critic.

A small convolutional encoder of the latent (global-average-pooled, so any latent size works), a sinusoidal
embedding of the noise level and the prompt's pooled text embedding, mixed by an MLP into one scalar.
DPOK's released value network is an MLP on the flattened latent and the CLIP text embedding whose hidden
units are gated by a per-timestep embedding; this module keeps those inputs with a size-independent encoder.
"""

from __future__ import annotations

import torch
from torch import nn

from flowrl.policies.flow_mlp import sinusoidal_embedding


def pooled_text(cond: dict[str, torch.Tensor]) -> torch.Tensor:
    """A `[N, D]` prompt vector from a policy's conditioning: its pooled embedding, else the token mean."""
    if "pooled" in cond:
        return cond["pooled"]
    return cond["prompt_embeds"].mean(dim=1)


class StateValueNet(nn.Module):
    """`V(x_t, sigma, text) -> [N]`.

    Args:
        latent_channels (`int`): channels of `[N, C, h, w]` latents, or the token width of packed `[N, L, D]`
            latents (Flux), which are treated as `[N, D, L, 1]`.
        text_dim (`int`): size of the pooled text embedding.
        hidden (`int`, defaults to 128): width of the encoder and the MLP.
        sigma_dim (`int`, defaults to 32): size of the noise-level embedding.
    """

    def __init__(self, latent_channels: int, text_dim: int, *, hidden: int = 128, sigma_dim: int = 32):
        super().__init__()
        self.sigma_dim = sigma_dim
        self.encoder = nn.Sequential(
            nn.Conv2d(latent_channels, hidden, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(hidden, hidden, 3, padding=1),
            nn.SiLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(
            nn.Linear(hidden + sigma_dim + text_dim, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, latents: torch.Tensor, sigmas: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = latents.float()
        if x.ndim == 3:  # packed tokens [N, L, D] -> a D-channel column
            x = x.transpose(1, 2).unsqueeze(-1)
        features = [self.encoder(x), sinusoidal_embedding(sigmas.float(), self.sigma_dim), text.float()]
        return self.head(torch.cat(features, dim=-1)).squeeze(-1)
