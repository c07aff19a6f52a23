"""Flow-GRPO (Liu et al. 2025, arXiv:2505.05470): GRPO on the per-step Gaussian policy of a flow-SDE sampler.

Per epoch: m prompts x k samples with the flow-SDE sampler (`sampling`), group-relative advantages of the
terminal reward (group mean, group or global std, clipped to +-5), then PPO-clip on each trained step's
log-ratio `log pi_theta(x_{t+1} | x_t) - log pi_old(...)` with the same advantage at every step, plus an
optional KL to the reference policy. Defaults follow Flow-GRPO's SD3.5 recipe (`config/grpo.py`): clip 1e-4,
global std, advantage clip 5, the first 99% of the steps (9 of 10), uniform step weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from flowrl import checkpoint
from flowrl.core import (
    STEP_SELECTIONS,
    STEP_WEIGHTINGS,
    PerPromptStatTracker,
    compute_policy_loss,
    gaussian_mean_kl,
    get_objective,
    grpo_guard_log_ratio,
    select_steps,
    step_weights,
)
from flowrl.core.ratios import reduce_elements
from flowrl.trainers.base import Trainer, TrainerConfig, seeded
from flowrl.trainers.registry import TRAINERS
from rewards import combine_advantages


@dataclasses.dataclass
class StepConfig:
    selection: str = "first_fraction"
    """Which stochastic steps train: `all`, `first_fraction`, `window`, `random` (`flowrl list`)."""
    fraction: float = 0.99
    """`first_fraction`: the first int(n * fraction) stochastic steps (Flow-GRPO 0.99: 9 of 10)."""
    window: tuple[int, int] | None = None
    """`window`: positions [start, end) among the stochastic steps."""
    k: int = 1
    """`random`: steps per sample, drawn per epoch (DDPO's per-sample subset)."""
    weighting: str = "uniform"
    """Per-step loss weight: `uniform`, `inv_dt` (GRPO-Guard), `min_snr`, `sigma` (`flowrl list`)."""
    normalize_weights: bool = False
    """Rescale step weights to mean 1 over the steps (comparable learning rates across weightings)."""

    def __post_init__(self):
        STEP_SELECTIONS.get(self.selection)
        STEP_WEIGHTINGS.get(self.weighting)


@dataclasses.dataclass
class FlowGRPOConfig(TrainerConfig):
    trainer: str = "flow_grpo"
    objective: str = "ppo"
    """Policy objective from the core (`flowrl list objectives`): ppo, gspo, sapo, spo, cispo, ..."""
    clip_eps_low: float = 1e-4
    """Lower clip range (for objectives that clip); with element-mean log-probs image ranges are tiny."""
    clip_eps_high: float | None = None
    """Upper clip range (None: same as low)."""
    objective_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra hyper-parameters of the objective (e.g. `tau_pos` for sapo, `eps` for spo)."""
    advantage: Literal["group", "per_prompt"] = "group"
    """`group`: z-score within this epoch's groups (Flow-GRPO). `per_prompt`: DDPO's running per-prompt
    statistics (`PerPromptStatTracker`: mean/std of each prompt's last `tracker_buffer` rewards, the epoch's
    batch statistics until it holds `tracker_min_count`); the buffers are saved in checkpoints."""
    tracker_buffer: int = 16
    """`per_prompt`: rewards remembered per prompt (DDPO's buffer_size 16)."""
    tracker_min_count: int = 16
    """`per_prompt`: rewards a prompt needs before its own statistics replace the batch's (DDPO: 16)."""
    adv_std: Literal["group", "global", "none"] = "global"
    """Advantage scale: per-group std, one std over the epoch (Flow-GRPO's global_std), or none."""
    adv_eps: float = 1e-4
    """Added to the std."""
    adv_clip: float | None = 5.0
    """Clip advantages to +-adv_clip."""
    adv_unbiased: bool = False
    """Sample (unbiased) std; Flow-GRPO uses numpy's population std."""
    kl_beta: float = 0.0
    """Weight of the KL to the reference policy (Flow-GRPO: 0.04 GenEval/OCR, 0.01 PickScore, 0 Flux)."""
    kl_form: Literal["exact", "flow_grpo"] = "flow_grpo"
    """`exact`: the Gaussian KL of each step; `flow_grpo`: Flow-GRPO's code form, the exact KL times |dt|."""
    steps: StepConfig = dataclasses.field(default_factory=StepConfig)
    """Which steps train and how much each weighs."""

    def __post_init__(self):
        super().__post_init__()
        get_objective(self.objective)
        if self.advantage == "per_prompt":
            if self.reward_aggregation != "sum":
                raise ValueError(
                    "advantage='per_prompt' tracks the weighted reward sum; "
                    f"reward_aggregation must be 'sum', got {self.reward_aggregation!r}"
                )
            if self.tracker_buffer < 1 or not 1 <= self.tracker_min_count <= self.tracker_buffer:
                raise ValueError(
                    "need 1 <= tracker_min_count <= tracker_buffer, "
                    f"got tracker_min_count={self.tracker_min_count}, tracker_buffer={self.tracker_buffer}"
                )


@TRAINERS.register(
    "flow_grpo", description="Flow-GRPO: PPO-clip on flow-SDE step log-probs with group advantages (arXiv:2505.05470)"
)
class FlowGRPOTrainer(Trainer):
    """Flow-GRPO; see the module docstring and `FlowGRPOConfig`."""

    config_class = FlowGRPOConfig

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        objective = get_objective(config.objective)
        hp = {k: getattr(config, k) for k in ("clip_eps_low", "clip_eps_high") if k in objective.hparams}
        self.objective_hparams = {**hp, **config.objective_kwargs}
        self.store_means = self.store_means or config.objective == "grpo_guard"
        self.tracker = None
        if config.advantage == "per_prompt":
            self.tracker = PerPromptStatTracker(config.tracker_buffer, config.tracker_min_count, eps=config.adv_eps,
                                                clip=config.adv_clip)  # fmt: skip
        if config.kl_beta and not (self.policy.has_lora or self.policy.reference_model is not None):
            self.policy.freeze_reference()  # full fine-tuning: the KL reference is a frozen copy

    def compute_advantages(self, rewards, group_ids, prompts=None):
        c = self.config
        if self.tracker is not None:
            if prompts is None:
                raise ValueError("advantage='per_prompt' needs the prompt texts")
            return self.tracker(self.combined_reward(rewards).float(), prompts)
        return combine_advantages(rewards, self.reward_weights, group_ids, mode=c.reward_aggregation, std=c.adv_std,
                                  eps=c.adv_eps, unbiased=c.adv_unbiased, clip=c.adv_clip)  # fmt: skip

    def train_steps(self, rollout, epoch):
        s = self.config.steps
        sde = rollout.sde_steps
        kwargs = {"all": {}, "first_fraction": {"fraction": s.fraction}, "random": {"k": s.k}}.get(s.selection)
        if s.selection == "window":
            start, end = s.window or (0, len(sde))
            kwargs = {"start": start, "end": end}
        if s.selection == "random":
            kwargs["generator"] = seeded(self.config.run.seed, epoch, 4, self.accelerator.process_index)
        return sde[select_steps(s.selection, len(sde), len(rollout), **kwargs)]

    def step_loss(self, batch, advantages, steps):
        c = self.config
        out = self.policy.score(batch, steps)  # log_prob [b, 1], mean [b, 1, ...], std [b, 1]
        old = batch.log_probs.gather(1, steps.to(batch.log_probs.device)[:, None])  # [b, 1]
        hp = dict(self.objective_hparams)
        if c.steps.weighting != "uniform":
            weights = step_weights(c.steps.weighting, batch.sigmas.cpu(), normalize=c.steps.normalize_weights)
            hp["weights"] = weights[steps].to(old.device)[:, None]  # [b, 1]
        log_ratio = out.log_prob.detach() - old
        if c.objective == "grpo_guard":
            rows = torch.arange(len(batch), device=batch.means.device)
            old_mean = batch.means[rows, steps.to(rows.device)]  # [b, ...]
            mean_diff_sq = reduce_elements((out.mean[:, 0] - old_mean) ** 2, batch.reduce)[:, None]  # [b, 1]
            hp.update(std=out.std, mean_diff_sq=mean_diff_sq)
            log_ratio = grpo_guard_log_ratio(log_ratio, out.std, mean_diff_sq.detach())
        loss, metrics = compute_policy_loss(c.objective, out.log_prob, old, advantages.to(old.device), **hp)
        metrics = {k: v for k, v in metrics.items() if not k.endswith("_per_step")}
        metrics["_ratio"] = log_ratio.exp()[:, 0]
        metrics["_raw_ratio"] = (out.log_prob.detach() - old).exp()[:, 0]
        if c.kl_beta:
            ref = self.policy.score(batch, steps, reference=True)
            sigmas = batch.sigmas.to(old.device)
            dt = (sigmas[steps + 1] - sigmas[steps]) if c.kl_form == "flow_grpo" else None
            kl = gaussian_mean_kl(out.mean[:, 0], ref.mean[:, 0], out.std[:, 0], dt=dt, reduce=batch.reduce)  # [b]
            loss = loss + c.kl_beta * kl.mean()
            metrics["kl"] = kl.mean().detach()
        metrics["approx_kl"] = metrics.pop("approx_kl_k3")
        return loss, metrics

    def state_dict(self):
        state, tensors = super().state_dict()
        if self.tracker is not None:
            state["adv_tracker"] = self.tracker.state_dict()
        return state, tensors

    def load_state_dict(self, state, tensors):
        super().load_state_dict(state, tensors)
        if self.tracker is not None:
            if "adv_tracker" not in state:
                raise checkpoint.CheckpointError("checkpoint has no per-prompt tracker state (advantage='per_prompt')")
            self.tracker.load_state_dict(state["adv_tracker"])
