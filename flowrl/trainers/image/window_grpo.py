"""Presets of Flow-GRPO that change where the rollouts are stochastic and which steps train.

They are `FlowGRPO` with other defaults: the same loop, step kernels (`flowrl.policies.sde`), step
selection (`steps`) and the moving SDE window of `sampling.sde_window_schedule` (`flowrl.core.sde_window_at`).

- `mix_grpo` (MixGRPO, Li et al. 2025, arXiv:2507.21802; Tencent-Hunyuan/MixGRPO `train_grpo_flux.py`): a window
  of 4 flow-SDE steps with Euler ODE steps outside it, moved by one step every 25 iterations
  (`sample_strategy="progressive"`), every window step trained, group z-scores with the sample std, one initial
  noise per group (`sampling.init_same_noise`).
- `mix_grpo_flash` (MixGRPO-Flash, the same code's `--dpm_algorithm_type dpmsolver++ --dpm_apply_strategy post`):
  MixGRPO's window moved every 20 iterations; the steps after it re-discretised to `int((T - end + 1) * 0.4)`
  points and integrated with DPM-Solver++(2M) (`sampling.post_window_solver`), so a rollout makes
  `end + that - 1` network calls instead of T (Flash*: a frozen window, ratio 0.2).
- `flow_grpo_fast` (Flow-GRPO-Fast, yifan123/flow_grpo `train_sd3_fast.py`, `config/grpo.py::*_fast_nocfg`): a
  window of 3 CPS steps (noise level 0.8) drawn uniformly from the first half of the 10 steps each epoch, ODE
  elsewhere, CFG-free, clip 1e-5 on CPS's `-mean (x' - mu)^2` log-probs, every window step trained.
- `dance_grpo` (DanceGRPO, Xue et al. 2025, arXiv:2505.07818; XueZeyue/DanceGRPO `train_grpo_flux.py`): its SDE
  (`dance_sde`, constant eta 0.3) on 16 steps with the last transition dropped, a random 60% of the 15 steps
  trained per sample (9), group z-scores with the sample std, clip 1e-4, one initial noise per group.

Not reproduced: DanceGRPO's best-of-n and per-reward surrogates.
"""

from __future__ import annotations

import dataclasses

from flowrl.image import SamplingConfig, StepConfig
from flowrl.run.registry import register
from flowrl.sections import AdvantageConfig, ObjectiveConfig
from flowrl.trainers.shared.flow_grpo import FlowGRPO, FlowGRPOConfig


def mix_sampling(**changes) -> SamplingConfig:
    """MixGRPO's sampling: flow-SDE (a 0.7) in a 4-step window moved by 1 step every 25 iterations, ODE outside
    it, one initial noise per group; `changes` for its variants."""
    settings = dict(
        sampler="flow_sde",
        noise_level=0.7,
        sde_window_schedule="progressive",
        window_size=4,
        window_every=25,
        window_stride=1,
        init_same_noise=True,
    )
    return SamplingConfig(**{**settings, **changes})


@dataclasses.dataclass
class MixGRPOConfig(FlowGRPOConfig):
    sampling: SamplingConfig = dataclasses.field(default_factory=mix_sampling)
    """Flow-SDE (a 0.7) inside a 4-step window that moves by 1 step every 25 epochs; ODE outside; a group's
    samples start from one noise (`--init_same_noise`)."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(std="group", clip=5.0, unbiased=True, eps=1e-8)
    )
    """Group mean and sample std + 1e-8, clipped to +-5 (MixGRPO's `advantage_aggr`, one reward)."""
    steps: StepConfig = dataclasses.field(default_factory=lambda: StepConfig(selection="all"))
    """Every stochastic (window) step trains."""


@dataclasses.dataclass
class MixGRPOFlashConfig(MixGRPOConfig):
    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: mix_sampling(
            window_every=20, post_window_solver="dpm_solver_2m", post_window_ratio=0.4
        )
    )
    """MixGRPO's window, moved every 20 epochs; after it, 0.4 of the remaining steps with DPM-Solver++(2M)
    (`--dpm_apply_strategy post`). Flash*: `window_stride: 0` (frozen at the first steps), `post_window_ratio: 0.2`."""


@dataclasses.dataclass
class FlowGRPOFastConfig(FlowGRPOConfig):
    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: SamplingConfig(
            guidance_scale=1.0,
            sampler="cps",
            noise_level=0.8,
            sde_window_schedule="random",
            window_size=3,
            window_span=(0, 5),
        )
    )
    """CFG-free CPS (a 0.8) in a 3-step window with a uniform start in the first half of the 10 steps."""
    objective: ObjectiveConfig = dataclasses.field(default_factory=lambda: ObjectiveConfig(clip_eps_low=1e-5))
    """PPO-clip 1e-5 (`*_fast_nocfg`; CPS log-probs are `-mean (x' - mu)^2`, no 1/(2 s^2))."""
    steps: StepConfig = dataclasses.field(default_factory=lambda: StepConfig(selection="all"))
    """Every window step trains."""


@dataclasses.dataclass
class DanceGRPOConfig(FlowGRPOConfig):
    sampling: SamplingConfig = dataclasses.field(
        default_factory=lambda: SamplingConfig(
            num_steps=16, sampler="dance_sde", noise_level=0.3, sde_window=(0, 15), init_same_noise=True
        )
    )
    """DanceGRPO's SDE (eta 0.3) on 16 steps; the last transition is ODE and never trained (`--ignore_last`); a
    group's samples start from one noise (`--init_same_noise`)."""
    advantage: AdvantageConfig = dataclasses.field(
        default_factory=lambda: AdvantageConfig(std="group", clip=5.0, unbiased=True, eps=1e-8)
    )
    """Group mean and sample std + 1e-8 (`--use_group`), clipped to +-5."""
    steps: StepConfig = dataclasses.field(default_factory=lambda: StepConfig(selection="random", k=9))
    """A random int(15 * 0.6) = 9 of the 15 stochastic steps per sample (timestep fraction 0.6)."""


@register("mix_grpo", description="MixGRPO: Flow-GRPO on a sliding SDE window, ODE outside it (arXiv:2507.21802)")
class MixGRPO(FlowGRPO):
    """MixGRPO; see the module docstring."""

    config_class = MixGRPOConfig
    time_kinds = ("flow",)  # flow-SDE windows


@register(
    "mix_grpo_flash",
    description="MixGRPO-Flash: MixGRPO with fewer DPM-Solver++(2M) steps after the window (arXiv:2507.21802)",
)
class MixGRPOFlash(FlowGRPO):
    """MixGRPO-Flash; see the module docstring."""

    config_class = MixGRPOFlashConfig
    time_kinds = ("flow",)  # flow-SDE windows


@register("flow_grpo_fast", description="Flow-GRPO-Fast: a random 3-step CPS window per epoch, ODE outside, no CFG")
class FlowGRPOFast(FlowGRPO):
    """Flow-GRPO-Fast; see the module docstring."""

    config_class = FlowGRPOFastConfig
    time_kinds = ("flow",)  # flow-SDE windows


@register("dance_grpo", description="DanceGRPO: its SDE, a random 60% of the steps per sample (arXiv:2505.07818)")
class DanceGRPO(FlowGRPO):
    """DanceGRPO; see the module docstring."""

    config_class = DanceGRPOConfig
    time_kinds = ("flow",)  # flow-SDE windows
