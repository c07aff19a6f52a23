"""Flow-DPPO (Ping et al. 2026, arXiv:2606.11025): Flow-GRPO with a divergence mask in place of ratio clipping.

Everything is Flow-GRPO's (the flow-SDE rollout, group advantages, per-step log-ratios) except the trust region:
the core's `flow_dppo` objective keeps the unclipped `-A r` and drops a step only where the exact KL of the old and
new step kernels, `||mu_theta - mu_old||^2 / (2 s^2)` (mean over latent elements), is at least `delta` while the
ratio moved in the advantage's direction. Rollouts keep each step's behaviour mean, as GRPO-Guard's do.

Defaults follow the authors' release (Tencent-Hunyuan/UniRL `examples/diffusion/sd3_flowdppo.yaml`,
`FlowDPPO/config.yaml`): `kl_mask_threshold` 1e-5 with the std normalisation on, flow-SDE eta 0.7 on 10 steps with
3 stochastic steps in the first half and ODE steps elsewhere, no CFG (guidance 1), every stochastic step trained,
group means divided by one batch-wide sample std + 1e-8 (`adv_use_global_std: true`), no advantage clip. UniRL
draws its 3 stochastic steps as a random subset of steps 0-4 each rollout; flowrl's stochastic steps form a
window, so the preset draws a random window of 3 consecutive steps in `[0, 5)` each epoch (Flow-GRPO-Fast's
schedule; verl-omni's example also uses a window, of 2 in `[0, 5]`).
"""

from __future__ import annotations

import dataclasses

from flowrl.image import SamplingConfig, StepConfig
from flowrl.run.registry import register
from flowrl.sections import AdvantageConfig, ObjectiveConfig
from flowrl.trainers.shared.flow_grpo import FlowGRPO, FlowGRPOConfig


@dataclasses.dataclass
class FlowDPPOConfig(FlowGRPOConfig):
    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: SamplingConfig(
            guidance_scale=1.0,
            noise_level=0.7,
            sampler="flow_sde",
            sde_window_schedule="random",
            window_size=3,
            window_span=(0, 5),
        )
    )
    """CFG-free flow-SDE (a 0.7) on 3 consecutive steps drawn each epoch from the first half of the 10; ODE elsewhere
    (UniRL's `AllSDEScheduler(num_sde_steps=3, timestep_fraction=[0.0, 0.5])`, as a window)."""
    objective: ObjectiveConfig = dataclasses.field(default_factory=lambda: ObjectiveConfig(name="flow_dppo"))
    """The core's `flow_dppo` objective: `delta` 1e-5 on the mean-reduced step KL (`objective.kwargs.delta`)."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(std="global", unbiased=True, eps=1e-8, clip=None)
    )
    """Group mean, one batch-wide sample std + 1e-8 (UniRL's `compute_advantages(use_global_std=True)`), no clip."""
    steps: StepConfig = dataclasses.field(default_factory=lambda: StepConfig(selection="all"))
    """Every stochastic step trains (UniRL replays every SDE step)."""

    def __post_init__(self):
        super().__post_init__()
        if self.objective.name != "flow_dppo":
            raise ValueError(
                f"flow_dppo trains the flow_dppo objective; got objective.name={self.objective.name!r} "
                "(flow_grpo takes any objective)"
            )


@register(
    "flow_dppo",
    description="Flow-DPPO: Flow-GRPO with an exact step-KL mask in place of ratio clipping (arXiv:2606.11025)",
)
class FlowDPPO(FlowGRPO):
    """Flow-DPPO; see the module docstring. Rollouts keep each step's behaviour mean for the step KL."""

    config_class = FlowDPPOConfig
    time_kinds = ("flow",)  # flow-SDE windows
