"""Policies: step kernels with log-probs, the diffusion policy over diffusers models, FPO and FIND pieces."""

from flowrl.policies.diffusion import DiffusionPolicy, DiffusionRollout, Transitions, from_callable
from flowrl.policies.rollout import Record, Rollout, per_sample
from flowrl.policies.sde import SAMPLERS, StepOutput, ddim_step, sde_step


__all__ = [
    "SAMPLERS",
    "DiffusionPolicy",
    "DiffusionRollout",
    "Record",
    "Rollout",
    "StepOutput",
    "Transitions",
    "ddim_step",
    "from_callable",
    "per_sample",
    "sde_step",
]
