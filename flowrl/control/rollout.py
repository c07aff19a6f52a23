"""The control modality's rollout: transitions of vectorised environments with what each algorithm re-scores."""

from __future__ import annotations

import dataclasses

import torch

from flowrl.policies.fpo import FPODraws
from flowrl.policies.rollout import Record, per_sample


@dataclasses.dataclass
class ControlRollout(Record):
    """`B = num_envs * steps_per_env` transitions, time-major (row `t * num_envs + e`); with several processes,
    each holds the rows of its environments (`Collected.rows` are their positions).

    `log_probs [B, K]` are the behaviour policy's element log-probabilities: K = 1 for a Gaussian action, the
    K denoising steps of a flow policy's chain (denoising MDP), or FPO's draws (`-l_old`, the pseudo
    log-likelihood whose differences are FPO's log-ratio).
    """

    obs: torch.Tensor = per_sample()
    """`[B, obs_dim]` the observations the policy saw (normalised with the statistics frozen for the epoch)."""
    actions: torch.Tensor = per_sample()
    """`[B, act_dim]` actions as sampled (unclipped; clipped to the action box only for `env.step`)."""
    values: torch.Tensor = per_sample()
    """`[B]` value estimates at collection."""
    advantages: torch.Tensor = per_sample()
    """`[B]` GAE advantages (before any normalisation)."""
    returns: torch.Tensor = per_sample()
    """`[B]` value targets, `advantages + values`."""
    log_probs: torch.Tensor | None = per_sample(default=None)
    """`[B, K]` fp32 behaviour log-probabilities of the elements (an algorithm adds them after collection)."""
    chain: torch.Tensor | None = per_sample(default=None)
    """`[B, K + 1, act_dim]` a flow policy's denoising chain (denoising-MDP mode)."""
    draws: FPODraws | None = per_sample(default=None)
    """FPO's stored `(tau, eps)` draws and behaviour losses."""

    @property
    def mask(self) -> torch.Tensor:
        return torch.ones(self.log_probs.shape, dtype=torch.bool, device=self.log_probs.device)

    @property
    def group_ids(self) -> torch.Tensor:
        """Every transition is its own group (advantages come from GAE, not from groups)."""
        return torch.arange(len(self))
