"""The sections of an algorithm's loss: `objective` (the core's ratio objective), `advantage` (how rewards become
advantages) and `kl` (the regulariser to a reference). `flowrl.sections` re-exports them; configs reach them
through `HasObjective`, `HasKL` and the prompted configs. `ess_scaling` (VCPO's step scaling) is the update's,
through `HasESSScaling`."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ClassVar, Literal

from flowrl.registry import unknown_name_error


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
    """Other hyper-parameters of the objective (`dual_clip_c`, sapo's `tau_pos`, ...)."""
    agg: str | None = None
    """Aggregation over the `[B, K]` elements (`token_mean`, `seq_mean_token_mean`, ...); None: the objective's."""
    target_kl: float | None = None
    """Stop the epoch's update once a mini-batch's approximate KL exceeds `1.5 * target_kl`, before its optimizer
    step (SB3's early stop); None: never."""

    def __post_init__(self):
        from flowrl.core import AGGREGATIONS, get_objective
        from flowrl.core.objectives import RENAMED_HPARAMS

        objective = get_objective(self.name)
        params = [*objective.hparams, *objective.required]
        for key in ("clip_eps_low", "clip_eps_high"):
            if getattr(self, key) is not None and key not in params:
                raise ValueError(
                    f"objective {self.name!r} has no {key}; its hyper-parameters are "
                    f"{', '.join(params) or 'none'} (set them in objective.kwargs)"
                )
        for key in self.kwargs:
            if key in ("clip_eps_low", "clip_eps_high", "agg"):
                raise ValueError(f"set {key} as objective.{key}, not in objective.kwargs")
            if key in RENAMED_HPARAMS and key not in params:
                now = RENAMED_HPARAMS[key].split()[0]
                place = f"objective.{now}" if now.startswith("clip_eps") else f"objective.kwargs.{now}"
                raise ValueError(f"objective.kwargs.{key} was renamed: use {place}")
            if key not in params:
                raise unknown_name_error("hyper-parameter", key, params, where=f"for objective {self.name!r}")
        if self.agg is not None and self.agg not in AGGREGATIONS:
            raise unknown_name_error("aggregation", self.agg, list(AGGREGATIONS))
        if self.target_kl is not None and self.target_kl <= 0:
            raise ValueError(f"objective.target_kl must be > 0 (or null), got {self.target_kl}")

    def hparams(self) -> dict[str, Any]:
        """The hyper-parameters set here (the objective's own defaults fill in the rest)."""
        out = {k: getattr(self, k) for k in ("clip_eps_low", "clip_eps_high", "agg") if getattr(self, k) is not None}
        return {**out, **self.kwargs}


@dataclasses.dataclass
class AdvantageConfig:
    """How a sample's advantage comes from its rewards: an estimator of the core's registry (`flowrl list
    advantage_estimators`) and its options; each estimator reads the options it takes."""

    selector: ClassVar[str] = "estimator"
    estimators: ClassVar[tuple[str, ...]] = ("group", "batch", "leave_one_out", "per_prompt", "sas", "raw")
    """The registered estimators of prompt groups (a modality lists its own)."""
    estimator: str = "group"
    """`group`: z-score within each prompt's group (GRPO, Flow-GRPO); `batch`: over the whole batch;
    `leave_one_out`: the mean of the group's other samples as baseline (RLOO, LOOP); `per_prompt`: DDPO's
    running per-prompt statistics (saved in checkpoints); `sas`: DCPO's smooth advantage standardisation, this
    step's group z-score blended with the prompt's pooled history (saved in checkpoints); `raw`: the reward
    itself (a learned baseline is subtracted later: DPOK's value network, FIND's calibration network); or your own
    `package.module:function` with the `(rewards [N], group_ids [N], **options)` signature of `group`."""
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
        if ":" not in self.estimator and self.estimator not in self.estimators:
            from flowrl.core import ADVANTAGES

            ADVANTAGES.get(self.estimator)  # an unknown name lists the registered ones
            raise ValueError(
                f"advantage.estimator {self.estimator!r} does not apply here; choose from {', '.join(self.estimators)}"
            )
        if self.estimator == "leave_one_out" and self.std == "global":
            raise ValueError("advantage.std=global does not apply to leave_one_out; use group or none")
        if self.estimator == "per_prompt" and not 1 <= self.min_count <= self.buffer_size:
            raise ValueError(
                "advantage.per_prompt needs 1 <= min_count <= buffer_size, "
                f"got min_count={self.min_count}, buffer_size={self.buffer_size}"
            )
        if self.clip is not None and self.clip <= 0:
            raise ValueError("advantage.clip must be > 0 (or null)")

    def options(self, fn) -> dict[str, Any]:
        """The options `fn` (an estimator function or class) takes, by its signature; `eps` only when set."""
        params = inspect.signature(fn).parameters
        values = {
            "std": self.std,
            "eps": self.eps,
            "clip": self.clip,
            "unbiased": self.unbiased,
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "normalize_std": self.std == "group",
        }  # leave-one-out: divide by the group's std or not
        return {k: v for k, v in values.items() if k in params and not (k == "eps" and v is None)}


@dataclasses.dataclass
class KLConfig:
    """The regulariser that keeps the policy near its reference (the pre-trained model, or FIND's prior)."""

    beta: float = 0.0
    """Its weight in the loss (0: off; Flow-GRPO: 0.04 GenEval/OCR, 0.01 PickScore; DPOK: 0.1)."""
    form: str = "gaussian"
    """How it is measured; each trainer lists its forms. Denoising steps: `gaussian` (the exact KL of the two
    step kernels), `gaussian_dt` (Flow-GRPO's code: that KL times |dt|), `eps_mse` (DPOK's code: the squared
    difference of the guided predictions); FIND: `proxy` (its released `mean(mu^2 + (sigma - 1)^2)`) or
    `gaussian` (the exact KL of the noise policy to N(0, I)); flow matching: `w2` (the velocity MSE bound); text:
    `k1`, `k2`, `k3` per token."""
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
class ESSScalingConfig:
    """VCPO's learning-rate scaling by the effective sample size of each optimizer step's importance weights
    (Huang et al. 2026, arXiv:2602.17616; mit-han-lab/vcpo `ess_scaling`): `flowrl.run.ess`."""

    rule: Literal["none", "sqrt", "linear"] = "none"
    """`none`: off. `sqrt` (VCPO's, for AdamW-style optimizers): `lr <- lr sqrt(min(1, rho / base_ratio))`;
    `linear`: `lr <- lr min(1, rho / base_ratio)`, where `rho = ESS / B = (sum w)^2 / (B sum w^2)` over the
    mini-batch's B sequences and `w` is each sequence's ratio `prod_t pi_theta / pi_old` before the step."""
    base_ratio: float = 1.0
    """The ESS ratio at and above which the learning rate is unchanged (VCPO's `base_ess_ratio`)."""

    def __post_init__(self):
        if not self.base_ratio > 0:
            raise ValueError(f"ess_scaling.base_ratio must be > 0, got {self.base_ratio}")


@dataclasses.dataclass
class HasESSScaling:
    """An algorithm whose optimizer steps may be scaled by the ESS of their importance weights (the text trainer;
    the update scheduler asks `flowrl.run.ess.ESSScaling.of`)."""

    ess_scaling: ESSScalingConfig = dataclasses.field(default_factory=ESSScalingConfig)
    """VCPO's ESS learning-rate scaling (`rule: sqrt` turns it on; `configs/llm/arith_vcpo.yaml`)."""
