"""Flow Policy Optimization's likelihood-free ratio (McAllister et al. 2025, arXiv:2507.21053).

For an action `a` (a control action, or an image's final latent) FPO draws `N` pairs `(tau_i, eps_i)` once, at
rollout, and stores them with the behaviour policy's conditional flow-matching losses
`l_old_i = || v_old(x_tau_i, tau_i) - (eps_i - a) ||^2` (mean over action elements), where
`x_tau = (1 - tau) a + tau eps` (flowrl's convention, as SD3: tau = 1 is noise). The ratio is

    r = exp( mean_i l_old_i - mean_i l_theta_i )           (mode "mean", FPO's default), or
    r_i = exp( clamp(l_old_i - l_theta_i, -c, c) )          (mode "per_draw", one ratio per draw).

Because the draws are stored, `r` is exactly 1 at the behaviour parameters (re-drawing them would not be),
and at that point the gradient of the PPO surrogate is the advantage-weighted flow-matching gradient
`A grad mean_i l_theta_i`. Hand the log-ratio to the core as `compute_policy_loss(name, log_ratio,
zeros_like(log_ratio), advantages)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flowrl.policies.rollout import Record, per_sample


VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`velocity_fn(x_tau [B * N, ...], tau [B * N]) -> v [B * N, ...]`; rows are sample-major (sample b's N draws
are contiguous), so per-sample conditioning is repeated with `repeat_interleave(N)`."""


@dataclass
class FPODraws(Record):
    """The Monte-Carlo pairs `(tau, eps)` of conditional flow matching drawn per sample, and (FPO) the
    behaviour policy's losses on them. AC-Flow keeps the same draws without losses."""

    taus: torch.Tensor = per_sample()
    """`[B, N]` noise levels in (0, 1)."""
    noises: torch.Tensor = per_sample()
    """`[B, N, ...]` standard normal noise, one per draw."""
    old_losses: torch.Tensor | None = per_sample(default=None)
    """`[B, N]` fp32 flow-matching losses of the behaviour policy (FPO's ratio needs them)."""


def cfm_losses(
    velocity_fn: VelocityFn,
    actions: torch.Tensor,
    taus: torch.Tensor,
    noises: torch.Tensor,
    *,
    supervise: str = "velocity",
):
    """Per-draw conditional flow-matching losses `[B, N]` (mean over action elements, fp32).

    `x_tau = (1 - tau) a + tau eps`, target velocity `eps - a`. `supervise="velocity"` regresses the velocity
    (FPO's `u`); `"eps"` is FPO's `u_but_supervise_as_eps` (the playground default): the network still
    outputs a velocity, the loss is on the noise it implies, `eps^ = x_tau + (1 - tau) v^`, i.e. the velocity
    error weighted by `(1 - tau)^2`.
    """
    if supervise not in ("velocity", "eps"):
        raise ValueError(f"supervise must be 'velocity' or 'eps', got {supervise!r}")
    b, n = taus.shape
    a = actions.unsqueeze(1).to(torch.float32)  # [B, 1, ...]
    tau = taus.to(torch.float32).reshape(b, n, *([1] * (actions.ndim - 1)))  # [B, N, 1, ...]
    eps = noises.to(torch.float32)
    x_tau = (1 - tau) * a + tau * eps  # [B, N, ...]
    target = eps - a
    v = velocity_fn(x_tau.reshape(b * n, *actions.shape[1:]).to(actions.dtype), taus.reshape(b * n))
    err = v.to(torch.float32).reshape(b, n, *actions.shape[1:]) - target
    if supervise == "eps":  # eps^ - eps = (x_tau + (1 - tau) v^) - (x_tau + (1 - tau) v) = (1 - tau)(v^ - v)
        err = (1 - tau) * err
    return err.pow(2).flatten(2).mean(-1)  # [B, N]


def sample_taus(shape, *, generator=None, grid: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Noise levels for the draws: uniform on (0, 1), or uniform over a sampler's discrete `grid`
    (FPO's `discretize_t_for_training`)."""
    if grid is None:
        return torch.rand(shape, generator=generator, device=device)
    pick = torch.randint(len(grid), shape, generator=generator, device=device)
    return grid.to(device)[pick]


@torch.no_grad()
def draw(
    velocity_fn: VelocityFn,
    actions: torch.Tensor,
    num_draws: int = 8,
    *,
    generator: torch.Generator | None = None,
    grid: torch.Tensor | None = None,
    supervise: str = "velocity",
) -> FPODraws:
    """Draw and store `num_draws` pairs per action with the behaviour policy's losses (FPO's default N = 8)."""
    if num_draws < 1:
        raise ValueError(f"num_draws must be >= 1, got {num_draws}")
    b = actions.shape[0]
    taus = sample_taus((b, num_draws), generator=generator, grid=grid, device=actions.device)
    noises = torch.randn((b, num_draws, *actions.shape[1:]), generator=generator, device=actions.device)
    return FPODraws(taus, noises, cfm_losses(velocity_fn, actions, taus, noises, supervise=supervise))


def fpo_log_ratio(
    losses: torch.Tensor,
    old_losses: torch.Tensor,
    *,
    mode: str = "mean",
    clamp: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """FPO's log-ratio from current and stored per-draw losses `[B, N]`.

    Args:
        mode (`str`, defaults to `"mean"`): `"mean"` averages the losses before the exponent (one ratio per
            action, `[B]`); `"per_draw"` gives one ratio per draw (`[B, N]`).
        clamp (`float`, *optional*): clamp the log-ratio to `[-clamp, clamp]` (zero gradient outside); the
            FPO code clamps per-draw differences to 3. Defaults to 3 for `per_draw` and none for `mean`, as the
            authors' playground code (`compute_policy_loss` keeps `exp` finite by itself).
        temperature (`float`, defaults to 1.0): scales the loss difference (FPO's humanoid runs use a
            pseudo log-prob `-l / (2 * 0.05^2)`, i.e. temperature 200); `r_T = r^T`.
    """
    if losses.shape != old_losses.shape:
        raise ValueError(f"losses {tuple(losses.shape)} and old_losses {tuple(old_losses.shape)} differ")
    diff = temperature * (old_losses.detach() - losses)
    if mode == "mean":
        log_ratio = diff.mean(-1)
    elif mode == "per_draw":
        log_ratio = diff
        clamp = 3.0 if clamp is None else clamp
    else:
        raise ValueError(f"mode must be 'mean' or 'per_draw', got {mode!r}")
    return log_ratio if clamp is None else log_ratio.clamp(-clamp, clamp)
