"""The config sections every modality shares, and the base every trainer config builds on.

`BaseConfig` holds what any run has: `run` (folder, epochs, seeds, logging, checkpoints, precision, sharding),
`optim` (the optimizer and its gradient handling), `batch` (the batch contract: samples per optimizer step over
every process, rows per network call on each process, inner epochs) and `eval` (cadence and the best / early-stop
watch). A modality adds its own sections (`flowrl.image.config.ImageConfig`, `flowrl.control.config.ControlConfig`,
`flowrl.llm.config.TextConfig`), and an algorithm adds the pieces it uses: `HasObjective` (the core's ratio
objective), `HasKL` (the regulariser to a reference). No config carries a section its trainer ignores.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

from flowrl.async_sections import AsynchronyConfig
from flowrl.config import run_checks
from flowrl.objective_sections import AdvantageConfig, KLConfig, ObjectiveConfig


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
    samples_every: int = 10
    """Save the latest epoch's samples every this many epochs (0: never): an image grid with prompts and rewards
    (`images/`), completions (`samples/`), the bimodal task's action field."""
    log_with: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    """accelerate trackers (`tensorboard`, `wandb`); metrics.jsonl is always written."""
    plots: bool = True
    """PNG curves of the rewards, evaluations, trust-region diagnostics and loss in `plots/` at the run's end
    (metrics.jsonl holds the same numbers; drawing them takes matplotlib about 0.2 s, which adds up over a sweep of
    many short runs)."""
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
    'flowrl-toolkit[deepspeed]'`). GPUs or CPUs; image trainers on the shared update (`docs/distributed.md`).
    Ignored on one process."""
    offload: bool = False
    """With `run.shard` fsdp2 or zero2/zero3: keep the sharded parameters (FSDP2, ZeRO-3), gradients and optimizer
    state in CPU memory and move each unit to the device for its compute (FSDP2's `CPUOffloadPolicy`, DeepSpeed's
    `offload_optimizer` / `offload_param`): slower, for a model whose shards do not fit on the GPUs."""
    check_memory: bool = True
    """Before a run on a CUDA GPU, trace its memory per phase (`flowrl plan`, at this launch's process count and the
    GPU's memory) and refuse a run that will not fit, in one line naming the setting to change."""
    mode: Literal["sync", "async"] = "sync"
    """`sync`: rollout, rewards and update take turns on the same processes; `async`: rollout workers on Ray sample
    while the learner trains, with bounded staleness (the `asynchrony` section, docs/async.md)."""
    threads: Literal["auto", "torch"] | int = "auto"
    """CPU threads of torch's kernels: `auto` uses the cores other processes leave free, re-measured every epoch
    (fast alone, graceful beside a second run or a reward server); an integer fixes the count; `torch` leaves
    torch's default (`flowrl.threads`; `OMP_NUM_THREADS` or `FLOWRL_THREADING=torch` in the environment win)."""

    def __post_init__(self):
        from flowrl.threads import check_setting

        check_setting(self.threads)
        run_checks(
            [
                (self.epochs >= 1, "run.epochs must be >= 1"),
                (0 <= self.max_bad_reward_frac <= 1, "run.max_bad_reward_frac must lie in [0, 1]"),
            ]
        )


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
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule over the run's epochs: constant, or a cosine / linear decay from `lr` at the first
    epoch to `lr * final_lr_ratio` at the last (set per epoch, so a resumed run continues on the same curve)."""
    final_lr_ratio: float = 0.1
    """The last epoch's learning rate as a fraction of `lr` (`cosine` and `linear` schedules)."""
    optimizer: Literal["adamw", "rmsprop"] = "adamw"
    """`adamw` (weight decay 0 is Adam), or `rmsprop` (alpha 0.99, `eps`, no weight decay: SB3's A2C optimizer,
    for the "A2C is a special case of PPO" settings)."""
    max_nonfinite_steps: int = 10
    """A step whose gradient is NaN or infinite is skipped (no update, counted in `nonfinite_steps`); the run
    stops with an error once this many were skipped (0: at the first), keeping its last checkpoint."""
    step_grad_norms_every: int = 0
    """Every this many epochs (0: never), log each denoising step's gradient norm (`grad_norm/step_t`, the mean
    over the epoch's micro-batches of the norm of that step's share of the gradient): those epochs run the
    `per_step` backward (the same gradient up to float rounding) and copy the gradient once per step. For
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
        run_checks(
            [
                (
                    self.lr > 0 and 0 <= self.final_lr_ratio <= 1,
                    "optim.lr must be > 0 and optim.final_lr_ratio in [0, 1]",
                ),
                (
                    self.max_nonfinite_steps >= 0,
                    f"optim.max_nonfinite_steps must be >= 0, got {self.max_nonfinite_steps}",
                ),
            ]
        )


@dataclasses.dataclass
class BatchConfig:
    """The batch contract: the algorithm in global terms, memory per process (verl's global mini-batch and per-GPU
    micro-batch). The same config gives the same optimizer steps and results on any number of processes and for
    any `micro_batch_size`, up to floating-point reduction order (`docs/distributed.md`)."""

    mini_batch_size: int | None = 32
    """Samples one optimizer step consumes, counted over every process (images and text: samples; control:
    transitions; DPOK: buffer transitions). Each inner epoch shuffles the trainable samples and cuts them into
    mini-batches of this many; the last one holds the remainder. None: the whole batch in one step."""
    micro_batch_size: int = 32
    """Rows per network call on each process: rollouts, re-scoring and each forward and backward of the update
    (a process's rows of a mini-batch are cut into micro-batches of this many and their gradients accumulated).
    Memory only: it never changes what one optimizer step computes."""
    inner_epochs: int = 1
    """Passes over each epoch's samples (PPO epochs)."""
    backward: Literal["auto", "whole", "per_step"] = "auto"
    """`whole`: one backward per micro-batch over all its trained elements `[b, k]`. `per_step`: one backward per
    element column (denoising step), so only one step's activations are in memory (large models); the gradient
    is the same up to float rounding. `auto`: `per_step` wherever the loss separates by element, unless all of a
    micro-batch's elements fit in one network call (then `whole`: the same memory, fewer calls); `whole` for losses
    that couple a row's elements (GSPO's trajectory ratio)."""

    def __post_init__(self):
        run_checks(
            [
                (self.micro_batch_size >= 1, f"batch.micro_batch_size must be >= 1, got {self.micro_batch_size}"),
                (
                    self.mini_batch_size is None or self.mini_batch_size >= 1,
                    f"batch.mini_batch_size must be >= 1 (or null: the whole batch), got {self.mini_batch_size}",
                ),
                (self.inner_epochs >= 1, f"batch.inner_epochs must be >= 1, got {self.inner_epochs}"),
            ]
        )


@dataclasses.dataclass
class EvalConfig:
    """Evaluation cadence and what is watched (a modality adds what it samples)."""

    every: int = 5
    """Evaluate every this many epochs (and always before the first and after the last); 0: start and end only."""
    seed: int = 1234
    """Noise seed of evaluation: the same noise at every evaluation, so curves compare like with like."""
    best_metric: str | None = None
    """Keep `checkpoints/best`, the evaluation with the highest value of this metric (`reward`, `digits_gold`,
    any `eval/*` name; a leading `-` keeps the lowest, e.g. `-digits_realism`), on the validation prompts when the
    run has them (`prompts.val`), else on the test prompts; None: no best checkpoint."""
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
            raise ValueError(
                "eval.stop_on_drop needs eval.best_metric (what to watch) and a positive amount, got "
                f"best_metric={self.best_metric!r}, stop_on_drop={self.stop_on_drop}"
            )

    def best_key(self) -> tuple[str, float] | None:
        """`("eval/<metric>", sign)` of `best_metric` (sign -1: lower is better), or None."""
        if not self.best_metric:
            return None
        name, sign = (self.best_metric[1:], -1.0) if self.best_metric.startswith("-") else (self.best_metric, 1.0)
        return (name if name.startswith("eval/") else f"eval/{name}"), sign

    def gold_metrics(self) -> list[str]:
        """Metrics that are never optimised (the first is the run's gold metric in `summary.json`)."""
        return list(getattr(self, "metrics", []))


@dataclasses.dataclass
class RewardConfig:
    name: str = "digits_alignment"
    """A registered reward (`flowrl list rewards`) or `package.module:attribute`."""
    weight: float = 1.0
    """Weight in the combined reward."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Constructor arguments of the reward (weights paths, device, batch_size, ...)."""


@dataclasses.dataclass
class PromptConfig:
    train: str = "digits/train"
    """Training prompt set: a shipped name (`flowrl.prompts`) or a .txt / .jsonl path."""
    test: str = "digits/test"
    """Evaluation prompt set (`eval/...`: what a run reports)."""
    val: str | None = None
    """Validation prompt set of image trainers, kept apart from the test set (`val/...`, evaluated beside it):
    what `eval.best_metric` (the best checkpoint, `eval.restore_best`, `eval.stop_on_drop`) selects on, so that
    the test set's numbers are never the ones a checkpoint was chosen by. None: they select on the test set."""
    prompts_per_epoch: int = 16
    """Distinct prompts m sampled per epoch (the rollout: m x k samples over every process)."""
    group_size: int = 8
    """Samples k per prompt (the group of group-relative advantages)."""

    def __post_init__(self):
        run_checks(
            [
                (self.prompts_per_epoch >= 1, "prompts.prompts_per_epoch must be >= 1"),
                (self.group_size >= 1, "prompts.group_size must be >= 1"),
            ]
        )


RENAMED = {
    "sampling.train_batch_size": "batch.micro_batch_size",
    "optim.gradient_accumulation": "batch.mini_batch_size (samples per optimizer step over every process; it was "
    "forward_batch_size x gradient_accumulation x processes)",
    "optim.backward": "batch.backward",
    "inner_epochs": "batch.inner_epochs",
    "run.images_every": "run.samples_every",
    "clip_eps_low": "objective.clip_eps_low",
    "clip_eps_high": "objective.clip_eps_high",
    "clip_eps": "objective.clip_eps_low",
    "objective_kwargs": "objective.kwargs",
    "target_kl": "objective.target_kl",
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
"""Keys of earlier flowrl versions and where each went (every trainer; configs add their own)."""


@dataclasses.dataclass
class BaseConfig:
    """What every trainer's config has. A modality adds its sections, an algorithm its pieces and fields."""

    renamed: ClassVar[dict[str, str]] = RENAMED
    absent: ClassVar[dict[str, str]] = {}
    """Keys other trainers have that this one does not, and why (the message when one is set)."""
    registered_name: ClassVar[str] = ""
    """The name the trainer registry gave this config class's trainer (the `trainer` key's default)."""

    trainer: str = ""
    """Registered trainer name (`flowrl list trainers`)."""
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    """Run folder, epochs, seeds, logging, checkpoints."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """The optimizer and gradient handling."""
    batch: BatchConfig = dataclasses.field(default_factory=BatchConfig)
    """The batch contract: samples per optimizer step (over every process), rows per call (per process)."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Evaluation cadence and the best / early-stop watch."""
    asynchrony: AsynchronyConfig = dataclasses.field(default_factory=AsynchronyConfig)
    """Rollout workers, weight publishing and the staleness bound of `run.mode: async`."""
    ema_decay: float | None = None
    """EMA of the trained weights for evaluation (Flow-GRPO: 0.9); None: off."""
    ema_every: int = 8
    """Optimizer steps between EMA updates (Flow-GRPO: 8)."""

    def __post_init__(self):
        if not self.trainer:  # the trainer registry names each config class once (`registered_name`)
            self.trainer = getattr(type(self), "registered_name", "")
        run_checks(self.checks())

    def checks(self) -> list[tuple[bool, str]]:
        """`(condition, message)` pairs the config must satisfy; sections and algorithms add theirs."""
        return [(self.ema_decay is None or 0 < self.ema_decay < 1, "ema_decay must lie in (0, 1)")]

    @classmethod
    def renamed_keys(cls) -> dict[str, str]:
        """Old config keys -> their new place (old keys fail with a message naming the new one)."""
        merged = {}
        for klass in reversed(cls.__mro__):
            merged.update(getattr(klass, "renamed", {}) or {})
        return merged

    @classmethod
    def absent_keys(cls) -> dict[str, str]:
        """Sections and keys this trainer has no use for -> why (`absent` of the class and its bases)."""
        merged = {}
        for klass in reversed(cls.__mro__):
            merged.update(getattr(klass, "absent", {}) or {})
        fields = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in merged.items() if k not in fields}


@dataclasses.dataclass
class HasObjective:
    """An algorithm whose policy loss is a ratio objective of the core."""

    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    """The policy objective and its trust region."""


@dataclasses.dataclass
class HasKL:
    """An algorithm with a regulariser to a reference; `kl_forms` are the forms it implements."""

    kl_forms: ClassVar[tuple[str, ...]] = ("gaussian",)
    kl: KLConfig = dataclasses.field(default_factory=KLConfig)
    """The regulariser to the reference."""

    def checks(self):
        name = self.trainer or "this trainer"
        return [
            *super().checks(),
            (
                self.kl.form in self.kl_forms,
                f"kl.form {self.kl.form!r} is not one of {name}'s: {', '.join(self.kl_forms)}",
            ),
        ]


@dataclasses.dataclass
class HasGroupFilter:
    """An algorithm that may skip the groups whose advantages are all 0 (the run's driver drops them before
    `prepare`); DPOK, which stores every transition, has no such switch."""

    drop_zero_std_groups: bool = True
    """Skip training on groups whose advantages are all 0 (equal rewards under a group baseline: no signal)."""


@dataclasses.dataclass
class PromptedConfig(BaseConfig):
    """The modalities that sample groups of outputs per prompt and score them with rewards (images, text)."""

    prompts: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    """Prompt sets and the m x k grouping."""
    rewards: list[RewardConfig] = dataclasses.field(default_factory=lambda: [RewardConfig()])
    """Rewards and their weights."""
    reward_aggregation: Literal["sum", "gdpo"] = "sum"
    """`sum`: advantages of the weighted reward sum (Flow-GRPO); `gdpo`: each reward's advantages, weighted."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    """The advantage estimator."""

    def checks(self) -> list[tuple[bool, str]]:
        p, a = self.prompts, self.advantage
        return [
            *super().checks(),
            (len(self.rewards) >= 1, "rewards needs at least one reward"),
            (
                a.estimator not in ("per_prompt", "sas") or self.reward_aggregation == "sum",
                f"advantage.estimator={a.estimator} tracks the weighted reward sum; reward_aggregation must be 'sum'",
            ),
            (
                a.estimator != "sas" or p.group_size >= 2,
                "advantage.estimator=sas needs prompts.group_size >= 2 (each step's group std)",
            ),
            (
                a.estimator != "leave_one_out" or p.group_size >= 2,
                "the leave_one_out baseline needs prompts.group_size >= 2 (the k - 1 others of each sample)",
            ),
            (
                a.estimator != "group" or p.group_size >= 2,
                "group-relative advantages need prompts.group_size >= 2: a group of one sample has advantage 0, so "
                "nothing would ever train (or choose advantage.estimator: batch, per_prompt or raw)",
            ),
        ]
