"""Typed run configs: dataclasses with a docstring per field, filled from YAML plus `--set key=value` overrides.

The sections every trainer shares (`model`, `sampling`, `prompts`, `rewards`, `objective`, `advantage`, `kl`,
`steps`, `eval`, `optim`, `run`) and their base `TrainerConfig` live here; each trainer's config subclasses it
in its own module, and `flowrl.trainers.load_config` picks the class from the `trainer` key. YAML files only
override defaults. An unknown key fails with a message naming it, the close matches and the valid keys (a key
of an earlier version names its new place); a value of the wrong type or outside a `Literal` fails naming the
key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml

from flowrl.registry import check_kwargs, unknown_name_error


class ConfigError(ValueError):
    """An invalid config key or value; the message names the key."""


# ----------------------------------------------------------------------------------------------
# shared sections
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelConfig:
    name: str = "digits"
    """`digits` (the embedded offline world), or a diffusers hub id / local folder (SD3.5, Flux.1, SD1.x)."""
    family: str | None = None
    """Model family for hub ids (`sd3`, `flux`, `unet`: `flowrl list model_families`); detected from
    `model_index.json` for folders."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Weights dtype (bf16 for SD3.5/Flux on GPU; log-prob math is fp32 regardless)."""
    lora_rank: int = 0
    """LoRA rank; 0 trains every weight (full fine-tuning)."""
    lora_alpha: float | None = None
    """LoRA alpha (defaults to the rank; Flow-GRPO uses rank 32, alpha 64)."""
    lora_targets: list[str] | None = None
    """LoRA target modules (defaults: the attention projections of the family)."""
    max_sequence_length: int | None = None
    """Text tokens for T5 (SD3 256, Flux 512 by default)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more time)."""
    digits_pretrain_steps: int = 220
    """Digits world only: pretraining steps of the base model (few, so RL has headroom)."""

    def __post_init__(self):
        if self.family is not None:
            from flowrl.policies.adapters import MODEL_FAMILIES

            MODEL_FAMILIES.get(self.family)  # an unknown family fails naming the registered ones


@dataclasses.dataclass
class SamplingConfig:
    num_steps: int = 10
    """Denoising steps T of training rollouts."""
    guidance_scale: float = 4.5
    """Classifier-free guidance in rollouts and training (Flux: its guidance embedding)."""
    noise_level: float = 0.7
    """The sampler's noise (`flow_sde` a, `dance_sde` eta, `cps` a, `ddim` eta)."""
    sampler: str = "flow_sde"
    """Step kernel: `flow_sde`, `dance_sde`, `cps`, `cps_gaussian`, `ode` (flow models) or `ddim` (UNets)."""
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
    forward_batch_size: int = 32
    """Rows per network forward, in rollouts and when re-scoring; training minibatches have this many samples
    too, so a minibatch re-scores in the chunks it was sampled in."""
    reward_overlap: int = 1
    """Sample the epoch in this many sequential parts and score each finished part on reward threads
    (`flowrl.rewards.RewardExecutor`) while the next part samples; 1: sample everything, then score. Each part
    draws its noise from its own seeded stream, so runs with different values sample different trajectories."""

    def __post_init__(self):
        if self.reward_overlap < 1:
            raise ValueError(f"sampling.reward_overlap must be >= 1, got {self.reward_overlap}")
        if self.num_steps < 1:
            raise ValueError("sampling.num_steps must be >= 1")
        if self.forward_batch_size < 1:
            raise ValueError("sampling.forward_batch_size must be >= 1")
        if not 0 < self.post_window_ratio <= 1:
            raise ValueError(f"sampling.post_window_ratio must be in (0, 1], got {self.post_window_ratio}")
        if self.sde_window_schedule != "fixed":
            from flowrl.core import sde_window_at

            # every epoch's window is valid (and a random one fits) before anything runs
            for epoch in range(2):
                sde_window_at(self.sde_window_schedule, epoch, self.num_steps, size=self.window_size,
                              every=self.window_every, stride=self.window_stride, span=self.window_span)  # fmt: skip


@dataclasses.dataclass
class PromptConfig:
    train: str = "digits/train"
    """Training prompt set: a shipped name (`flowrl.prompts`) or a .txt / .jsonl path."""
    test: str = "digits/test"
    """Evaluation prompt set."""
    prompts_per_epoch: int = 16
    """Distinct prompts m sampled per epoch."""
    group_size: int = 8
    """Samples k per prompt (the group of group-relative advantages)."""


@dataclasses.dataclass
class RewardConfig:
    name: str = "digits_alignment"
    """A registered reward (`flowrl list rewards`) or `package.module:attribute`."""
    weight: float = 1.0
    """Weight in the combined reward."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Constructor arguments of the reward (weights paths, device, batch_size, ...)."""


@dataclasses.dataclass
class EvalConfig:
    every: int = 5
    """Evaluate every this many epochs (and always before the first and after the last); 0: start and end only."""
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
    seed: int = 1234
    """Noise seed of evaluation: the same noise at every evaluation, so curves compare like with like."""
    best_metric: str | None = None
    """Keep `checkpoints/best`, the evaluation with the highest value of this metric (`reward`, `digits_gold`,
    any `eval/*` name; a leading `-` keeps the lowest, e.g. `-digits_realism`); None: no best checkpoint."""
    restore_best: bool = False
    """At the end of the run, restore the best checkpoint's weights (early stopping on a held-out metric): the
    final checkpoint, `eval_end` in `summary.json`, `flowrl eval` and `flowrl export` then use them."""
    stop_on_drop: float | None = None
    """Stop the run when `best_metric` falls this far below its best evaluation (in its own units, e.g. 0.05
    of gold accuracy): the over-optimisation brake. The run ends there as if it had reached `run.epochs`
    (final checkpoint, `restore_best`); None: never stop early."""

    def __post_init__(self):
        if self.restore_best and not self.best_metric:
            raise ValueError("eval.restore_best needs eval.best_metric (which evaluation is the best)")
        if self.stop_on_drop is not None and (not self.best_metric or self.stop_on_drop <= 0):
            raise ValueError("eval.stop_on_drop needs eval.best_metric (what to watch) and a positive amount, got "
                             f"best_metric={self.best_metric!r}, stop_on_drop={self.stop_on_drop}")  # fmt: skip

    def best_key(self) -> tuple[str, float] | None:
        """`("eval/<metric>", sign)` of `best_metric` (sign -1: lower is better), or None."""
        if not self.best_metric:
            return None
        name, sign = (self.best_metric[1:], -1.0) if self.best_metric.startswith("-") else (self.best_metric, 1.0)
        return (name if name.startswith("eval/") else f"eval/{name}"), sign


@dataclasses.dataclass
class OptimConfig:
    lr: float = 3e-4
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float | None = 1.0
    """Gradient-norm clipping (None: off)."""
    gradient_accumulation: int = 1
    """Minibatches per optimizer step (each minibatch contributes all its trained steps)."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule over the run's epochs: constant, or a cosine / linear decay from `lr` at the first
    epoch to `lr * final_lr_ratio` at the last (set per epoch, so a resumed run continues on the same curve)."""
    final_lr_ratio: float = 0.1
    """The last epoch's learning rate as a fraction of `lr` (`cosine` and `linear` schedules)."""
    optimizer: Literal["adamw", "rmsprop"] = "adamw"
    """`adamw` (weight decay 0 is Adam), or `rmsprop` (alpha 0.99, `eps`, no weight decay: SB3's A2C optimizer,
    for the "A2C is a special case of PPO" settings)."""
    backward: Literal["whole", "per_step"] = "whole"
    """`whole`: one loss and one backward per minibatch over all its trained steps `[b, k]`. `per_step`: one
    backward per step column, so only one step's activations are in memory (large models); the gradient is
    the same (exact up to float rounding), and objectives that couple the steps (GSPO) pay one extra
    no-grad pass to fix their coefficients `dL/dlogp` first."""
    max_nonfinite_steps: int = 10
    """A step whose gradient is NaN or infinite is skipped (no update, counted in `nonfinite_steps`); the run
    stops with an error once this many were skipped (0: at the first), keeping its last checkpoint."""
    step_grad_norms_every: int = 0
    """Every this many epochs (0: never), log each denoising step's gradient norm (`grad_norm/step_t`, the mean
    over the epoch's minibatches of the norm of that step's share of the minibatch gradient): those epochs run
    the `per_step` backward (the same gradient up to float rounding) and copy the gradient once per step. For
    element-wise objectives; a diagnostic for `flowrl ablate`'s per-step plots."""

    def lr_at(self, epoch: int, epochs: int) -> float:
        """The learning rate of epoch `epoch` (0-based) of a run of `epochs`."""
        if self.schedule == "constant" or epochs <= 1:
            return self.lr
        progress = epoch / (epochs - 1)  # 0 at the first epoch, 1 at the last
        if self.schedule == "cosine":
            factor = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            factor = 1 - progress
        return self.lr * (self.final_lr_ratio + (1 - self.final_lr_ratio) * factor)

    def __post_init__(self):
        if self.lr <= 0 or not 0 <= self.final_lr_ratio <= 1:
            raise ValueError("optim.lr must be > 0 and optim.final_lr_ratio in [0, 1]")
        if self.max_nonfinite_steps < 0:
            raise ValueError(f"optim.max_nonfinite_steps must be >= 0, got {self.max_nonfinite_steps}")


@dataclasses.dataclass
class RunConfig:
    output_dir: str = "runs/{trainer}-{time}"
    """Run folder; `{trainer}` and `{time}` are filled in."""
    seed: int = 0
    """Seeds prompt sampling, rollout noise and minibatch order (per epoch, so resumed runs are identical)."""
    epochs: int = 50
    """Training epochs (one rollout batch each)."""
    save_every: int = 10
    """Checkpoint every this many epochs (and at the end); 0: only at the end."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep (older ones are deleted)."""
    images_every: int = 10
    """Save an image grid with prompts and rewards every this many epochs (0: never)."""
    log_with: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    """accelerate trackers (`tensorboard`, `wandb`); metrics.jsonl and PNG plots are always written."""
    max_bad_reward_frac: float = 0.1
    """Abort when more than this fraction of an epoch's rewards is NaN/inf (they are dropped and counted)."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """accelerate mixed precision (GPU)."""
    cpu: bool = False
    """Force the CPU even when a GPU is present."""
    shard: Literal["none", "fsdp2", "zero2", "zero3"] = "none"
    """With several processes: `none` keeps a full model, gradients and optimizer state on each (DDP); `fsdp2`
    shards the trained model's parameters, gradients and AdamW state over the processes (`fully_shard`); `zero2`
    (DeepSpeed ZeRO-2) shards the gradients and optimizer state, `zero3` the parameters too (`pip install
    'flowrl[deepspeed]'`). GPUs or CPUs; image trainers on the shared update (`docs/distributed.md`). Ignored on
    one process."""
    threads: Literal["auto", "torch"] | int = "auto"
    """CPU threads of torch's kernels: `auto` uses the cores other processes leave free, re-measured every epoch
    (fast alone, graceful beside a second run or a reward server); an integer fixes the count; `torch` leaves
    torch's default (`flowrl.threads`; `OMP_NUM_THREADS` or `FLOWRL_THREADING=torch` in the environment win)."""

    def __post_init__(self):
        from flowrl.threads import check_setting

        check_setting(self.threads)


@dataclasses.dataclass
class ObjectiveConfig:
    """The policy objective of the shared core (`flowrl.core.compute_policy_loss`)."""

    selector: ClassVar[str] = "name"
    name: str = "ppo"
    """A registered objective (`flowrl list objectives`): ppo, grpo, dapo, gspo, sapo, cispo, clamp, ..."""
    clip_eps_low: float | None = None
    """Lower clip range; None keeps the objective's own default (`docs/objectives.md`). Image log-probs are
    means over latent elements, so image clip ranges are tiny (Flow-GRPO: 1e-4 at SD3.5's 512 px)."""
    clip_eps_high: float | None = None
    """Upper clip range; None keeps the objective's own default (for most: equal to the lower one)."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other hyper-parameters of the objective (`dual_clip_c`, sapo's `tau_pos`, spo's `eps`, ...)."""
    agg: str | None = None
    """Aggregation over the `[B, K]` elements (`token_mean`, `seq_mean_token_mean`, ...); None: the objective's."""

    def __post_init__(self):
        from flowrl.core import AGGREGATIONS, get_objective

        objective = get_objective(self.name)
        params = [*objective.hparams, *objective.required]
        for key in ("clip_eps_low", "clip_eps_high"):
            if getattr(self, key) is not None and key not in params:
                raise ValueError(f"objective {self.name!r} has no {key}; its hyper-parameters are "
                                 f"{', '.join(params) or 'none'} (set them in objective.kwargs)")  # fmt: skip
        for key in self.kwargs:
            if key in ("clip_eps_low", "clip_eps_high", "agg"):
                raise ValueError(f"set {key} as objective.{key}, not in objective.kwargs")
            if key not in params:
                raise unknown_name_error("hyper-parameter", key, params, where=f"for objective {self.name!r}")
        if self.agg is not None and self.agg not in AGGREGATIONS:
            raise unknown_name_error("aggregation", self.agg, list(AGGREGATIONS))

    def hparams(self) -> dict[str, Any]:
        """The hyper-parameters set here (the objective's own defaults fill in the rest)."""
        out = {k: getattr(self, k) for k in ("clip_eps_low", "clip_eps_high", "agg") if getattr(self, k) is not None}
        return {**out, **self.kwargs}


@dataclasses.dataclass
class AdvantageConfig:
    """How a sample's advantage comes from its rewards (`flowrl list` shows the estimators)."""

    selector: ClassVar[str] = "estimator"
    estimator: Literal["group", "batch", "leave_one_out", "per_prompt", "sas", "raw"] = "group"
    """`group`: z-score within each prompt's group (GRPO, Flow-GRPO); `batch`: over the whole batch;
    `leave_one_out`: the mean of the group's other samples as baseline (RLOO, LOOP); `per_prompt`: DDPO's
    running per-prompt statistics (saved in checkpoints); `sas`: DCPO's smooth advantage standardisation, this
    step's group z-score blended with the prompt's pooled history (saved in checkpoints); `raw`: the reward
    itself (a learned baseline is subtracted later: DPOK's value network, FIND's calibration network)."""
    std: Literal["group", "global", "none"] = "group"
    """Scale: the group's std, one std over the epoch (Flow-GRPO's `global_std`), or none (Dr.GRPO). For
    `leave_one_out`, `group` divides by the group's std and `global` is not available."""
    eps: float | None = None
    """Added to the std; None: the estimator's own (1e-4 as Flow-GRPO and trl; `per_prompt` 1e-6 as DDPO's
    tracker)."""
    clip: float | None = None
    """Clip advantages to `[-clip, clip]` (Flow-GRPO, DDPO: 5)."""
    unbiased: bool = True
    """Sample (unbiased) std; Flow-GRPO and DDPO use numpy's population std."""
    buffer_size: int = 16
    """`per_prompt`: rewards remembered per prompt (DDPO: 16)."""
    min_count: int = 16
    """`per_prompt`: rewards a prompt needs before its own statistics replace the batch's (DDPO: 16)."""

    def __post_init__(self):
        if self.estimator == "leave_one_out" and self.std == "global":
            raise ValueError("advantage.std=global does not apply to leave_one_out; use group or none")
        if self.estimator == "per_prompt" and not 1 <= self.min_count <= self.buffer_size:
            raise ValueError("advantage.per_prompt needs 1 <= min_count <= buffer_size, "
                             f"got min_count={self.min_count}, buffer_size={self.buffer_size}")  # fmt: skip
        if self.clip is not None and self.clip <= 0:
            raise ValueError("advantage.clip must be > 0 (or null)")


@dataclasses.dataclass
class KLConfig:
    """The regulariser that keeps the policy near its reference (the pre-trained model, or FIND's prior)."""

    beta: float = 0.0
    """Its weight in the loss (0: off; Flow-GRPO: 0.04 GenEval/OCR, 0.01 PickScore; DPOK: 0.1)."""
    form: str = "gaussian"
    """How it is measured; each trainer lists its forms. Denoising steps: `gaussian` (the exact KL of the two
    step kernels), `gaussian_dt` (Flow-GRPO's code: that KL times |dt|), `eps_mse` (DPOK's code: the squared
    difference of the guided predictions); FIND: `proxy` (its released `mean(mu^2 + (sigma - 1)^2)`) or
    `gaussian` (the exact KL of the noise policy to N(0, I)); AC-Flow: `w2` (the velocity MSE bound)."""
    warmup_epochs: int = 0
    """Epochs trained without it before it applies (DPOK's `kl_warmup`)."""
    reference_offload: bool = False
    """Full fine-tuning with a KL: keep the frozen reference copy in CPU memory and bring it to the device only
    while it scores (one model copy less on the GPU, one transfer each way per reference pass). LoRA runs need
    no copy: their reference is the network with the adapter disabled."""

    def __post_init__(self):
        if self.beta < 0 or self.warmup_epochs < 0:
            raise ValueError("kl.beta and kl.warmup_epochs must be >= 0")

    def coef(self, epoch: int) -> float:
        """beta from epoch `warmup_epochs` on, 0 before."""
        return self.beta if epoch >= self.warmup_epochs else 0.0


@dataclasses.dataclass
class StepConfig:
    """Which denoising steps train and how much each weighs: the axis users ablate."""

    selection: str = "first_fraction"
    """Which stochastic steps train: `all`, `first_fraction`, `window`, `random` (`flowrl list`)."""
    fraction: float = 0.99
    """`first_fraction`: the first int(n * fraction) stochastic steps (Flow-GRPO 0.99: 9 of 10)."""
    window: tuple[int, int] | None = None
    """`window`: positions [start, end) among the stochastic steps."""
    k: int = 1
    """`random`: steps per sample, drawn per epoch (DDPO's per-sample subset)."""
    weighting: str = "uniform"
    """Per-step loss weight: `uniform`, `inv_dt` (GRPO-Guard), `min_snr`, `min_snr_v`, `sigma`, `noise_aware`
    (TempFlow-GRPO), `early`, `late` (`flowrl list`), or your own `package.module:function` (`sigmas [T + 1]
    -> weights [T]`)."""
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


RENAMED = {
    "sampling.train_batch_size": "sampling.forward_batch_size",
    "clip_eps_low": "objective.clip_eps_low",
    "clip_eps_high": "objective.clip_eps_high",
    "clip_eps": "objective.clip_eps_low",
    "objective_kwargs": "objective.kwargs",
    "kl_beta": "kl.beta",
    "kl_weight": "kl.beta",
    "kl_form": "kl.form",
    "kl_warmup": "kl.warmup_epochs",
    "adv_std": "advantage.std",
    "adv_eps": "advantage.eps",
    "adv_clip": "advantage.clip",
    "adv_unbiased": "advantage.unbiased",
    "adv_normalize_std": "advantage.std (group: divide by the group's std; none: do not)",
    "tracker_buffer": "advantage.buffer_size",
    "tracker_min_count": "advantage.min_count",
}
"""Keys of earlier flowrl versions and where each went (every trainer; trainers add their own)."""


@dataclasses.dataclass
class TrainerConfig:
    """What every trainer shares. Algorithm fields live in the subclasses (one per trainer).

    A subclass lists the `kl.form`s it implements (`kl_forms`) and the shared sections it has no use for
    (`unused`: setting one fails instead of being ignored).
    """

    kl_forms: ClassVar[tuple[str, ...]] = ("gaussian",)
    unused: ClassVar[tuple[str, ...]] = ()
    renamed: ClassVar[dict[str, str]] = RENAMED

    trainer: str = ""
    """Registered trainer name (`flowrl list trainers`)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy's model."""
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    """Rollouts."""
    prompts: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    """Prompt sets and the m x k grouping."""
    rewards: list[RewardConfig] = dataclasses.field(default_factory=lambda: [RewardConfig()])
    """Rewards and their weights."""
    reward_aggregation: Literal["sum", "gdpo"] = "sum"
    """`sum`: advantages of the weighted reward sum (Flow-GRPO); `gdpo`: each reward's advantages, weighted."""
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    """The policy objective and its trust region."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    """The advantage estimator."""
    kl: KLConfig = dataclasses.field(default_factory=KLConfig)
    """The regulariser to the reference."""
    steps: StepConfig = dataclasses.field(default_factory=StepConfig)
    """Which denoising steps train and their weights."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Evaluation on the test prompts."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and gradient handling."""
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    """Run folder, epochs, seeds, logging, checkpoints."""
    inner_epochs: int = 1
    """Passes over each epoch's samples (PPO epochs)."""
    drop_zero_std_groups: bool = True
    """Skip training on groups whose advantages are all 0 (equal rewards under a group baseline: no signal)."""
    ema_decay: float | None = None
    """EMA of the trained weights for evaluation (Flow-GRPO: 0.9); None: off."""
    ema_every: int = 8
    """Optimizer steps between EMA updates (Flow-GRPO: 8)."""

    def __post_init__(self):
        for ok, message in self.checks():
            if not ok:
                raise ValueError(message)
        for name in self.unused:
            section = getattr(self, name)
            if section != type(section)():
                raise ValueError(f"{self.trainer} does not use the {name} section; remove it from the config")

    def checks(self) -> list[tuple[bool, str]]:
        """`(condition, message)` pairs the config must satisfy (a modality without prompts replaces them)."""
        p = self.prompts
        return [
            (self.run.epochs >= 1, "run.epochs must be >= 1"),
            (p.prompts_per_epoch >= 1, "prompts.prompts_per_epoch must be >= 1"),
            (p.group_size >= 1, "prompts.group_size must be >= 1"),
            (self.inner_epochs >= 1, "inner_epochs must be >= 1"),
            (self.optim.gradient_accumulation >= 1, "optim.gradient_accumulation must be >= 1"),
            (len(self.rewards) >= 1, "rewards needs at least one reward"),
            (0 <= self.run.max_bad_reward_frac <= 1, "run.max_bad_reward_frac must lie in [0, 1]"),
            (self.ema_decay is None or 0 < self.ema_decay < 1, "ema_decay must lie in (0, 1)"),
            (self.kl.form in self.kl_forms,
             f"kl.form {self.kl.form!r} is not one of {self.trainer or 'this trainer'}'s: {', '.join(self.kl_forms)}"),
            (self.advantage.estimator not in ("per_prompt", "sas") or self.reward_aggregation == "sum",
             f"advantage.estimator={self.advantage.estimator} tracks the weighted reward sum; reward_aggregation "
             "must be 'sum'"),
            (self.advantage.estimator != "sas" or p.group_size >= 2,
             "advantage.estimator=sas needs prompts.group_size >= 2 (each step's group std)"),
            (self.advantage.estimator != "leave_one_out" or p.group_size >= 2,
             "the leave_one_out baseline needs prompts.group_size >= 2 (the k - 1 others of each sample)"),
            (self.advantage.estimator != "group" or p.group_size >= 2,
             "group-relative advantages need prompts.group_size >= 2: a group of one sample has advantage 0, so "
             "nothing would ever train (or choose advantage.estimator: batch, per_prompt or raw)"),
        ]  # fmt: skip

    @classmethod
    def renamed_keys(cls) -> dict[str, str]:
        """Old config keys -> their new place (old keys fail with a message naming the new one)."""
        merged = {}
        for klass in reversed(cls.__mro__):
            merged.update(getattr(klass, "renamed", {}) or {})
        return merged


# ----------------------------------------------------------------------------------------------
# dict <-> dataclass with validation
# ----------------------------------------------------------------------------------------------


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp, key: str, renamed: dict[str, str] | None = None) -> Any:
    """`value` checked against (and lightly converted to) the annotation `tp`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(value, option, key, renamed)
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"invalid value {value!r} for {key}: {'; '.join(errors)}")
    if origin is Literal:
        if isinstance(value, bool) and not any(isinstance(a, bool) for a in args):
            # YAML 1.1 reads no/off/false (yes/on/true) as booleans: map them back to a spelled-out choice
            spellings = ("no", "off", "false") if value is False else ("yes", "on", "true")
            value = next((a for a in args if a in spellings), value)
        if value not in args:
            raise ConfigError(f"invalid value {value!r} for {key}; choose from {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        selector = getattr(tp, "selector", None)
        if selector and isinstance(value, str):
            raise ConfigError(
                f"{key} is a section: write {key}.{selector}: {value} (or {key}: {{{selector}: {value}}})"
            )
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=key, renamed=renamed)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key} must have {len(args)} entries, got {value!r}")
            return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        converted = [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(converted) if origin is tuple else converted
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {_type_name(tp)}")


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _merge(base: dict, update: dict) -> dict:
    """`update` over `base`, recursively for nested mappings."""
    merged = dict(base)
    for key, value in update.items():
        nested = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if nested else value
    return merged


def from_dict(cls, data: dict, prefix: str = "", renamed: dict[str, str] | None = None):
    """Build the dataclass `cls` from `data`, validating every key and value.

    `renamed` maps keys of earlier versions (full dotted paths) to where they went: using one fails with a
    message that names the new key.
    """
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields or not fields[key].init:
            if renamed and full in renamed:
                raise ConfigError(f"config key {full!r} was renamed: use {renamed[full]}")
            valid = [n for n, f in fields.items() if f.init]
            where = f"in section {prefix!r}" if prefix else "at the top level"
            message = str(unknown_name_error("config key", key, valid, where=where))
            raise ConfigError(message.replace(f"config key {key!r}", f"config key {full!r}", 1))
        default = _default(fields[key])
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            # a partial section overrides the *field's* defaults (a trainer may change them, e.g. GRPO-Guard's
            # step weighting), not the section class's; but a section that picks another algorithm piece
            # (objective.name, advantage.estimator) starts from the class defaults, so the trainer's settings
            # of its own piece (Flow-GRPO's clip range for ppo) do not leak into the chosen one
            selector = getattr(type(default), "selector", None)
            base = default
            if selector and selector in value and value[selector] != getattr(default, selector):
                base = type(default)(**{selector: getattr(default, selector)})
            value = _merge(to_dict(base), value)
        kwargs[key] = _convert(value, hints[key], full, renamed)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{prefix or cls.__name__}: {err}") from err


def to_dict(config) -> dict:
    """A YAML-friendly nested dict of a config (tuples become lists)."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(config)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides (values parsed as YAML: `1e-4`, `true`, `[1, 2]`, `null`)."""
    data = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def save_config(config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
