"""The image modality's config: the model, rollouts (sampling), evaluation, and which denoising steps train."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from flowrl.models.config import ModelConfig
from flowrl.registry import check_kwargs
from flowrl.sections import EvalConfig, PromptedConfig


@dataclasses.dataclass
class SamplingConfig:
    num_steps: int = 10
    """Denoising steps T of training rollouts."""
    guidance_scale: float = 4.5
    """Classifier-free guidance in rollouts and training (Flux: its guidance embedding)."""
    noise_level: float = 0.7
    """The sampler's noise (`flow_sde` a, `dance_sde` eta, `cps` a, `ddim` eta)."""
    sampler: str = "flow_sde"
    """Step kernel (`flowrl list samplers`): `flow_sde`, `dance_sde`, `cps`, `cps_gaussian`, `ode` (flow models) or
    `ddim` (UNets)."""
    sde_window: tuple[int, int] | None = None
    """Stochastic steps `[start, end)`; the others are ODE steps (MixGRPO / Flow-GRPO-Fast). None: all."""
    sde_window_schedule: Literal["fixed", "progressive", "random"] = "fixed"
    """How the window moves over training (`flowrl.core.sde_window_at`): `fixed` (`sde_window` every epoch),
    `progressive` (MixGRPO: `window_size` steps from the start of `window_span`, moved by `window_stride` every
    `window_every` epochs, wrapping around) or `random` (Flow-GRPO-Fast: a uniform start each epoch)."""
    window_size: int = 4
    """Steps in a moving window (MixGRPO 4, Flow-GRPO-Fast 3)."""
    window_every: int = 1
    """`progressive`: epochs before the window moves (MixGRPO: 25 iterations)."""
    window_stride: int = 1
    """`progressive`: steps the window moves each time (0 freezes it, MixGRPO-Flash*)."""
    window_span: tuple[int, int] | None = None
    """Steps `[lo, hi)` a moving window stays in; None: `[0, num_steps - 1)` (Flow-GRPO-Fast: `[0, T // 2)`)."""
    post_window_solver: Literal["euler", "dpm_solver_2m"] = "euler"
    """The steps after the SDE window: `euler` (ODE on the same grid) or `dpm_solver_2m` (MixGRPO-Flash:
    re-discretised to fewer steps, `post_window_ratio` of them, and integrated with DPM-Solver++(2M))."""
    post_window_ratio: float = 0.4
    """`dpm_solver_2m`: the fraction of the post-window steps kept (Flash 0.4, Flash* 0.2)."""
    init_same_noise: bool = False
    """Start every sample of a prompt's group from the same initial noise (MixGRPO's and DanceGRPO's
    `--init_same_noise`): the group differs only by the SDE steps' noise."""
    height: int | None = None
    """Image height (default: the model's)."""
    width: int | None = None
    """Image width (default: the model's)."""
    uncond_grad: bool = True
    """Whether the training gradient flows through CFG's unconditional branch: true (both branches in one call of
    twice the rows: the guided prediction's exact gradient, `s dv_text + (1 - s) dv_uncond`), or false (Flow-GRPO's
    SD3 script, which detaches it: the gradient `s dv_text` only; the unconditional branch runs in a call of its own
    without gradient, in rollouts too, so the ratio stays exactly 1: half the training activations and about a third
    less training compute)."""
    forward_batch_size: int | None = None
    """Rows per network call in rollouts (None: `batch.micro_batch_size`). Larger rollout calls than training calls
    run the GPU fuller; the stochastic steps' behaviour log-probs are then re-scored at the training calls' size
    (without gradient, a forward per stochastic step), so the ratio stays exactly 1 at the old weights: it pays when
    few steps are stochastic (Flow-GRPO-Fast, MixGRPO windows), not when every step is."""
    reward_overlap: int = 1
    """Sample the epoch in this many sequential parts and score each finished part on reward threads
    (`flowrl.rewards.RewardExecutor`) while the next part samples; 1: sample everything, then score. A sample's
    noise is seeded by its position, so this never changes the samples."""

    def __post_init__(self):
        from flowrl.core import sde_window_at
        from flowrl.policies import SAMPLERS

        SAMPLERS.get(self.sampler)  # an unknown sampler fails here, before anything is loaded or written
        if self.forward_batch_size is not None and self.forward_batch_size < 1:
            raise ValueError(f"sampling.forward_batch_size must be >= 1 (or null), got {self.forward_batch_size}")
        if self.reward_overlap < 1:
            raise ValueError(f"sampling.reward_overlap must be >= 1, got {self.reward_overlap}")
        if self.num_steps < 1:
            raise ValueError("sampling.num_steps must be >= 1")
        if not 0 < self.post_window_ratio <= 1:
            raise ValueError(f"sampling.post_window_ratio must be in (0, 1], got {self.post_window_ratio}")
        if self.sde_window_schedule != "fixed":
            # every epoch's window is valid (and a random one fits) before anything runs
            for epoch in range(2):
                sde_window_at(
                    self.sde_window_schedule,
                    epoch,
                    self.num_steps,
                    size=self.window_size,
                    every=self.window_every,
                    stride=self.window_stride,
                    span=self.window_span,
                )


@dataclasses.dataclass
class ImageEvalConfig(EvalConfig):
    """Held-out evaluation on the test prompts with fixed noise and the deterministic sampler."""

    samples_per_prompt: int = 4
    """Samples per test prompt."""
    max_prompts: int | None = None
    """Evaluate on at most this many test prompts (None: all)."""
    num_steps: int | None = None
    """Denoising steps of evaluation (default: the training steps)."""
    guidance_scale: float | None = None
    """Guidance of evaluation (default: the training guidance)."""
    metrics: list[str] = dataclasses.field(default_factory=list)
    """Extra per-sample metrics that are never optimised (gold metrics), by reward name."""


@dataclasses.dataclass
class StepConfig:
    """Which denoising steps train and how much each weighs: the axis users ablate."""

    selection: str = "first_fraction"
    """Which stochastic steps train: `all`, `first_fraction`, `window`, `random` (`flowrl list step_selections`)."""
    fraction: float = 0.99
    """`first_fraction`: the first int(n * fraction) stochastic steps (Flow-GRPO 0.99: 9 of 10)."""
    window: tuple[int, int] | None = None
    """`window`: positions [start, end) among the stochastic steps."""
    k: int = 1
    """`random`: steps per sample, drawn per epoch (DDPO's per-sample subset)."""
    weighting: str = "uniform"
    """Per-step loss weight: `uniform`, `inv_dt` (GRPO-Guard), `min_snr`, `min_snr_v`, `sigma`, `noise_aware`
    (TempFlow-GRPO), `early`, `late` (`flowrl list step_weightings`), or your own `package.module:function`
    (`sigmas [T + 1] -> weights [T]`)."""
    weighting_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the weighting (`min_snr`: `gamma`; `early`/`late`: `boundary`)."""
    normalize_weights: bool = False
    """Rescale step weights to mean 1 over the steps (comparable learning rates across weightings)."""

    def __post_init__(self):
        from flowrl.core import STEP_SELECTIONS, STEP_WEIGHTINGS

        STEP_SELECTIONS.get(self.selection)
        weighting = STEP_WEIGHTINGS.resolve(self.weighting)
        if not callable(weighting):
            raise ValueError(f"steps.weighting {self.weighting!r} names {type(weighting).__name__}, not a function")
        check_kwargs("step weighting", self.weighting, self.weighting_kwargs, weighting)


@dataclasses.dataclass
class ImageConfig(PromptedConfig):
    """What every image trainer's config has: the model, rollouts, prompts and rewards, the advantage, evaluation."""

    renamed: ClassVar[dict[str, str]] = {"model.max_sequence_length": "model.options.max_sequence_length"}
    absent: ClassVar[dict[str, str]] = {
        "objective": "this trainer's loss is likelihood-free: it has no ratio objective",
        "kl": "this trainer has no regulariser to a reference",
        "steps": "this trainer does not train on denoising steps (its elements are its own)",
        "env": "image trainers sample prompts, not environments",
        "generation": "image trainers sample images, not text",
    }

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy's model."""
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    """Rollouts."""
    eval: ImageEvalConfig = dataclasses.field(default_factory=ImageEvalConfig)
    """Evaluation on the test prompts."""


@dataclasses.dataclass
class HasSteps:
    """An image algorithm that trains on (a selection of) the rollout's denoising steps."""

    steps: StepConfig = dataclasses.field(default_factory=StepConfig)
    """Which denoising steps train and their weights."""
