"""Policies: step kernels with log-probs, the diffusion policy over diffusers models, FPO and FIND pieces."""

from flowrl.policies.diffusion import DiffusionPolicy, Rollout, from_callable
from flowrl.policies.sde import SAMPLERS, StepOutput, ddim_step, sde_step


__all__ = ["SAMPLERS", "DiffusionPolicy", "Rollout", "StepOutput", "ddim_step", "from_callable", "sde_step"]
