"""VCPO's learning-rate scaling from the effective sample size of each optimizer step's importance weights.

Huang, Zhang, Hu, Yang, Han 2026, "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv:2602.17616
(ESS-guided step scaling); the official code is mit-han-lab/vcpo (`compute_ess_info` in
`recipe/fully_async_policy/staleness_utils.py`, the scaling around the optimizer step in
`verl/workers/actor/megatron_actor.py`, `ESSScalingConfig` in `verl/workers/config/actor.py`). With `w_i` the
sequence importance weight of each of the mini-batch's B sequences (`exp sum_t (log pi_theta - log pi_old)` over
its trained tokens or steps, at the weights the step starts from),

    rho = ESS / B = (sum_i w_i)^2 / (B sum_i w_i^2),      s = min(1, rho / base_ratio),
    lr_step = lr sqrt(s)   (rule `sqrt`, VCPO's for AdamW-style optimizers)   or   lr s   (rule `linear`),

and the learning rate returns to `lr` after the step. `rho` is 1 when every weight is equal (on-policy: the first
mini-batch of an epoch) and `1 / B` when one sequence holds all the weight. The sums run over every process's rows
of the mini-batch (computed from a shared maximum, so no weight overflows). The update scheduler calls `observe` on
each batch's loss inputs and `step` around the optimizer step (`flowrl.run.scheduler`); a config turns it on
with an `ess_scaling` section (`rule`, `base_ratio`: the text trainer's, `flowrl.objective_sections.ESSScalingConfig`).
"""

from __future__ import annotations

import math

import torch

from flowrl.objective_sections import HasESSScaling


RULES = ("none", "sqrt", "linear")


def ess_ratio(seq_log_ratio: torch.Tensor) -> torch.Tensor:
    """`rho = (sum w)^2 / (B sum w^2)` of the weights `w = exp(seq_log_ratio [B])` (0-d; 1 for an empty batch)."""
    if seq_log_ratio.numel() == 0:
        return torch.ones((), dtype=seq_log_ratio.dtype)
    w = torch.exp(seq_log_ratio - seq_log_ratio.max())  # rho is scale-free: the largest weight becomes 1
    return w.sum().square() / (seq_log_ratio.numel() * w.square().sum())


def lr_scale(rho: float, rule: str, base_ratio: float = 1.0) -> float:
    """VCPO's factor on the learning rate: `sqrt(min(1, rho / base))` (`sqrt`), `min(1, rho / base)` (`linear`)."""
    if rule not in RULES:
        raise ValueError(f"ess_scaling.rule {rule!r} is not one of {', '.join(RULES)}")
    s = min(1.0, rho / base_ratio)
    return 1.0 if rule == "none" else math.sqrt(s) if rule == "sqrt" else s


class ESSScaling:
    """The scheduler's hook: the sequence log-ratios of a mini-batch, then a scaled learning rate for its step.

    Args:
        rule (`str`): `sqrt`, `linear` (or `none`: off).
        base_ratio (`float`): the ESS ratio at and above which the learning rate is unchanged.
        processes (`Processes`): the sums run over every process's rows.
    """

    def __init__(self, rule: str, base_ratio: float, processes):
        lr_scale(1.0, rule, base_ratio)  # validates the rule
        self.rule, self.base_ratio, self.processes = rule, base_ratio, processes
        self.seq: list[torch.Tensor] = []

    @classmethod
    def of(cls, config, processes) -> ESSScaling | None:
        """The hook of a trainer config with an `ess_scaling` section whose rule is not `none`; else None."""
        if not isinstance(config, HasESSScaling) or config.ess_scaling.rule == "none":
            return None
        return cls(config.ess_scaling.rule, config.ess_scaling.base_ratio, processes)

    @torch.no_grad()
    def observe(self, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
        """Add the sequences of one batch: `[b, K]` dense log-probs and mask, `rows [b]` False for padding rows."""
        seq = ((logp.detach().float() - old_logp.float()) * mask.to(logp.device).float()).sum(-1)  # [b]
        self.seq.append(seq[rows.to(seq.device).bool()].cpu())

    def step(self, engine) -> tuple[float, dict[str, float]]:
        """Step `engine` at the scaled learning rate (restored afterwards); returns its gradient norm and the
        step's `ess_ratio` and `ess_lr_scale`."""
        seq = torch.cat(self.seq).double() if self.seq else torch.zeros(0, dtype=torch.float64)
        self.seq = []
        top = self.processes.max(float(seq.max()) if len(seq) else -math.inf)
        w = torch.exp(seq - top)  # every process shares the same maximum
        sums = [self.processes.sum(float(x)) for x in (w.sum(), w.square().sum(), len(seq))]
        rho = sums[0] ** 2 / (sums[2] * sums[1]) if sums[2] and sums[1] > 0 else 1.0
        scale = lr_scale(rho, self.rule, self.base_ratio)
        groups = engine.optimizer.param_groups
        base = [group["lr"] for group in groups]
        for group, lr in zip(groups, base):
            group["lr"] = lr * scale
        try:
            norm = engine.step()
        finally:
            for group, lr in zip(groups, base):
                group["lr"] = lr
        return norm, {"ess_ratio": rho, "ess_lr_scale": scale}
