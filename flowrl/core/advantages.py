"""Advantage estimators: group-relative, leave-one-out, per-prompt running statistics, GAE.

Rewards are `[N]` tensors; groups are given by `group_ids` (`[N]` integers or any hashable per sample,
e.g. the prompt strings). Zero-variance groups (every reward equal) get advantage exactly 0 and are
counted in the returned statistics; they never become NaN.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from flowrl.registry import Registry


ADVANTAGES: Registry = Registry("advantage estimator")


def group_index(group_ids: torch.Tensor | Sequence[Hashable], device=None) -> tuple[torch.Tensor, int]:
    """Map per-sample group ids (ints, strings, ...) to `(inverse[N], num_groups)` with dense indices."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.ndim != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        _, inverse = torch.unique(group_ids, return_inverse=True)
        inverse = inverse.to(device or group_ids.device)
    else:
        first_seen: dict[Hashable, int] = {}
        inverse = torch.tensor([first_seen.setdefault(g, len(first_seen)) for g in group_ids], dtype=torch.long)
        inverse = inverse.to(device) if device is not None else inverse
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _check_rewards(rewards: torch.Tensor, n_groups_ids: int) -> torch.Tensor:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if rewards.shape[0] != n_groups_ids:
        raise ValueError(f"rewards has {rewards.shape[0]} entries but group_ids has {n_groups_ids}")
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise ValueError(f"rewards must be finite; non-finite at indices {bad[:10]} (drop or repair them first)")
    return rewards.detach().to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)


def _group_stats(r: torch.Tensor, inverse: torch.Tensor, num_groups: int):
    """Per-group count, mean, unbiased and population variance, and an 'all equal' flag, vectorised."""
    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count  # [G]
    sq = torch.zeros_like(count).index_add_(0, inverse, (r - mean[inverse]) ** 2)  # [G]
    var_pop = sq / count
    var_unbiased = sq / (count - 1).clamp_min(1.0)  # clamp: singleton groups have no spread, not 0/0
    high = torch.full_like(count, -math.inf).scatter_reduce(0, inverse, r, "amax")
    low = torch.full_like(count, math.inf).scatter_reduce(0, inverse, r, "amin")
    return count, mean, var_unbiased, var_pop, high == low


def _grouped(rewards: torch.Tensor, group_ids):
    """`(r, inverse, count, mean, var_unbiased, var_pop, degenerate)`: checked rewards and their group statistics."""
    inverse, num_groups = group_index(group_ids, device=rewards.device)
    r = _check_rewards(rewards, inverse.numel())
    return (r, inverse, *_group_stats(r, inverse, num_groups))


def _finish(adv: torch.Tensor, inverse: torch.Tensor, degenerate: torch.Tensor, clip: float | None):
    """The tail of every group estimator: 0 in the groups whose rewards are all equal, clipped to `[-clip, clip]`
    if given, and the statistics."""
    adv = torch.where(degenerate[inverse], torch.zeros_like(adv), adv)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv, _stats(adv, degenerate)


def _stats(adv: torch.Tensor, degenerate: torch.Tensor) -> dict[str, float]:
    num_groups = degenerate.numel()
    zero = int(degenerate.sum())
    return {
        "num_groups": num_groups,
        "zero_std_groups": zero,
        "zero_std_frac": zero / max(num_groups, 1),
        "adv_mean": float(adv.mean()) if adv.numel() else 0.0,
        "adv_std": float(adv.std(unbiased=False)) if adv.numel() else 0.0,
        "adv_abs_max": float(adv.abs().max()) if adv.numel() else 0.0,
    }


@ADVANTAGES.register("group")
def group_advantages(
    rewards: torch.Tensor,
    group_ids,
    *,
    std: str = "group",
    eps: float = 1e-4,
    clip: float | None = None,
    unbiased: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-relative advantages `(r - mean_group) / (std + eps)` (GRPO, arXiv:2402.03300 eq. 4).

    Args:
        rewards (`torch.Tensor`): `[N]` finite rewards.
        group_ids: `[N]` group of each sample (prompt index or prompt string).
        std (`str`, defaults to `"group"`): `"group"` (GRPO, GRPO-Guard), `"global"` (std over the whole
            batch, Flow-GRPO's `global_std`, Lite-PPO) or `"none"` (mean-centring only, Dr.GRPO).
        eps (`float`, defaults to 1e-4): added to the std (trl and Flow-GRPO use 1e-4, verl 1e-6).
        clip (`float`, *optional*): clip advantages to `[-clip, clip]` (Flow-GRPO and DDPO use 5).
        unbiased (`bool`, defaults to `True`): sample std (torch/verl/trl); `False` is numpy's population
            std used by Flow-GRPO and DDPO.

    Returns:
        `(advantages[N], stats)`; groups whose rewards are all equal (including singletons) get 0.
    """
    if std not in ("group", "global", "none"):
        raise ValueError(f"std must be one of 'group', 'global', 'none', got {std!r}")
    r, inverse, _, mean, var_unbiased, var_pop, degenerate = _grouped(rewards, group_ids)
    centred = r - mean[inverse]  # [N]
    if std == "group":
        scale = (var_unbiased if unbiased else var_pop).sqrt()[inverse] + eps
    elif std == "global":
        scale = r.std(unbiased=unbiased and r.numel() > 1) + eps
    else:
        scale = torch.ones_like(r)
    return _finish(centred / scale, inverse, degenerate, clip)


@ADVANTAGES.register("leave_one_out")
def leave_one_out_advantages(
    rewards: torch.Tensor,
    group_ids,
    *,
    normalize_std: bool = False,
    eps: float = 1e-4,
    clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Leave-one-out baseline `r_i - mean_{j != i} r_j = K/(K-1) (r_i - mean)` (RLOO; LOOP, arXiv:2503.00897).

    Args:
        rewards (`torch.Tensor`): `[N]` finite rewards.
        group_ids: `[N]` group of each sample; every group needs K >= 2 samples (the baseline of a
            single sample is undefined), groups may differ in size.
        normalize_std (`bool`, defaults to `False`): also divide by the group's sample std (+ `eps`).
        clip (`float`, *optional*): clip advantages to `[-clip, clip]`.
    """
    r, inverse, count, mean, var_unbiased, _, degenerate = _grouped(rewards, group_ids)
    if (count < 2).any():
        raise ValueError("leave-one-out advantages need at least 2 samples in every group (K >= 2)")
    k = count[inverse]
    adv = k / (k - 1) * (r - mean[inverse])  # [N]
    if normalize_std:
        adv = adv / (var_unbiased.sqrt()[inverse] + eps)
    return _finish(adv, inverse, degenerate, clip)


@ADVANTAGES.register("batch")
def batch_advantages(
    rewards: torch.Tensor,
    group_ids=None,
    *,
    std: str = "global",
    eps: float = 1e-4,
    clip: float | None = None,
    unbiased: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Batch-relative advantages `(r - mean) / (std + eps)` over every sample (one baseline for the batch).

    REINFORCE++'s global normalisation (arXiv:2501.03262) and AC-Flow's reward shaping; `group_ids` are
    ignored. `std`: `"global"` (or `"group"`: the batch is the one group) divides by the batch std, `"none"`
    only centres. A batch whose rewards are all equal gets 0.
    """
    if std not in ("group", "global", "none"):
        raise ValueError(f"std must be one of 'group', 'global', 'none', got {std!r}")
    one_group = torch.zeros(rewards.shape[0], dtype=torch.long, device=rewards.device)
    return group_advantages(
        rewards, one_group, std="none" if std == "none" else "group", eps=eps, clip=clip, unbiased=unbiased
    )


@ADVANTAGES.register("raw")
def raw_advantages(rewards: torch.Tensor, group_ids=None, *, clip: float | None = None):
    """The reward itself (clipped to `[-clip, clip]` if given): for trainers whose baseline is learned.

    DPOK subtracts its value network `V(x_t, t, c)` per transition and FIND its calibration network
    `V(mu, sigma, c)` per sample, so the estimator hands them the reward unchanged. `group_ids` are ignored.
    """
    r = _check_rewards(rewards, rewards.shape[0] if rewards.ndim == 1 else -1)
    adv = r.clamp(-clip, clip) if clip is not None else r.clone()
    return adv, _stats(adv, torch.zeros(0, dtype=torch.bool))


@ADVANTAGES.register("per_prompt")
class PerPromptStatTracker:
    """Per-prompt running reward statistics (DDPO, arXiv:2305.13301; `ddpo-pytorch` stat tracker).

    Keeps the last `buffer_size` rewards of every prompt. A prompt's advantage is
    `(r - mean) / (std + eps)` over its buffer (after adding this batch), or over the whole batch while
    the buffer holds fewer than `min_count` rewards. Population std, as the reference code.

    Args:
        buffer_size (`int`, defaults to 16): rewards remembered per prompt.
        min_count (`int`, defaults to 16): buffer length needed before the prompt's own statistics are used.
        eps (`float`, defaults to 1e-6): added to the std.
        clip (`float`, *optional*): clip advantages to `[-clip, clip]` (DDPO uses 5).
    """

    def __init__(self, buffer_size: int = 16, min_count: int = 16, eps: float = 1e-6, clip: float | None = None):
        if buffer_size < 1 or min_count < 1:
            raise ValueError(f"buffer_size and min_count must be >= 1, got {buffer_size}, {min_count}")
        self.buffer_size, self.min_count, self.eps, self.clip = buffer_size, min_count, eps, clip
        self.buffers: dict[str, deque] = {}

    def __call__(self, rewards: torch.Tensor, prompts: Sequence[str]) -> tuple[torch.Tensor, dict[str, float]]:
        """Add this batch to the buffers and return `(advantages[N], stats)`."""
        inverse, num_groups = group_index(list(prompts), device=rewards.device)
        r = _check_rewards(rewards, inverse.numel())
        batch_mean, batch_std = r.mean(), r.std(unbiased=False)
        adv = torch.empty_like(r)
        degenerate = torch.zeros(num_groups, dtype=torch.bool)
        unique = list(dict.fromkeys(prompts))  # in group-index order
        for g, prompt in enumerate(unique):  # a loop over distinct prompts, not over samples
            sel = inverse == g
            buffer = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buffer.extend(r[sel].tolist())
            if len(buffer) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                history = torch.tensor(list(buffer), dtype=r.dtype, device=r.device)
                mean, std = history.mean(), history.std(unbiased=False)
            degenerate[g] = bool(std == 0)
            adv[sel] = (r[sel] - mean) / (std + self.eps)
        if self.clip is not None:
            adv = adv.clamp(-self.clip, self.clip)
        return adv, _stats(adv, degenerate)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (settings and every prompt's buffer)."""
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "eps": self.eps,
            "clip": self.clip,
            "buffers": {p: list(b) for p, b in self.buffers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; settings must match this tracker's."""
        for key in ("buffer_size", "min_count"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"tracker {key} mismatch: state has {state.get(key)}, tracker has {getattr(self, key)}"
                )
        self.buffers = {p: deque(map(float, b), maxlen=self.buffer_size) for p, b in state["buffers"].items()}


@ADVANTAGES.register("sas")
class SmoothAdvantageStandardizer:
    """DCPO's Smooth Advantage Standardisation (SAS; Yang et al. 2025, arXiv:2509.02333 sec. 3.2; lime-RL/DCPO's
    `compute_dcpo_outcome_advantage`).

    Each prompt keeps `(i, mu_tot, sigma_tot)`: the number of steps it was sampled in and the pooled mean and
    std of its per-step groups. At the i-th visit, with this step's group statistics `(mu_new, sigma_new)`
    (sample std) folded into the pool as one more equally weighted group,

        A_new = (R - mu_new) / sigma_new,   A_tot = (R - mu_tot) / sigma_tot   (0 where the std is 0)
        SA_new = ((i-1)/i) A_new + (1/i) A_tot,   SA_tot = (1/i) A_new + ((i-1)/i) A_tot
        A = SA_new if |SA_new| < |SA_tot| else SA_tot

    so the first visit is the ordinary group z-score, and a group whose rewards are all equal still learns from
    the prompt's history (`A_tot / i`) instead of getting zero advantage. The pool update is the official one:
    `mu_tot = ((i-1) mu_old + mu_new) / i`, `sigma_tot^2 = ((i-1) sigma_old^2 + sigma_new^2 +
    ((i-1)/i) (mu_new - mu_old)^2) / i`. State is JSON-serialisable (`state_dict`), so checkpoints keep it.

    Args:
        clip (`float`, *optional*): clip advantages to `[-clip, clip]`.
    """

    def __init__(self, clip: float | None = None):
        self.clip = clip
        self.prompts: dict[str, tuple[int, float, float]] = {}
        """Each prompt's `(visits i, mu_tot, sigma_tot)`."""

    def __call__(self, rewards: torch.Tensor, prompts: Sequence[str]) -> tuple[torch.Tensor, dict[str, float]]:
        """Fold this batch into the per-prompt pools and return `(advantages[N], stats)`."""
        r, inverse, count, mean, var_unbiased, _, equal = _grouped(rewards, list(prompts))
        num_groups = count.numel()
        if num_groups and int(count.min()) < 2:
            raise ValueError(
                "advantage.estimator=sas needs at least 2 samples of every prompt per step "
                "(prompts.group_size >= 2): the group std is a sample std"
            )
        adv = torch.empty_like(r)
        degenerate = torch.zeros(num_groups, dtype=torch.bool)
        for g, prompt in enumerate(dict.fromkeys(prompts)):  # a loop over distinct prompts, not over samples
            sel = inverse == g
            # an all-equal group has std exactly 0 (its float mean may differ from the rewards by rounding)
            mu_new, sigma_new = float(mean[g]), 0.0 if bool(equal[g]) else math.sqrt(float(var_unbiased[g]))
            visits, mu_old, sigma_old = self.prompts.get(prompt, (0, 0.0, 0.0))
            i = visits + 1
            if visits == 0:
                mu_tot, sigma_tot = mu_new, sigma_new
            else:
                mu_tot = (visits * mu_old + mu_new) / i
                var = (visits * sigma_old**2 + sigma_new**2 + visits / i * (mu_new - mu_old) ** 2) / i
                sigma_tot = math.sqrt(var)
            self.prompts[prompt] = (i, mu_tot, sigma_tot)
            a_new = (r[sel] - mu_new) / sigma_new if sigma_new > 0 else torch.zeros_like(r[sel])
            a_tot = (r[sel] - mu_tot) / sigma_tot if sigma_tot > 0 else torch.zeros_like(r[sel])
            sa_new = (i - 1) / i * a_new + a_tot / i
            sa_tot = a_new / i + (i - 1) / i * a_tot
            adv[sel] = torch.where(sa_new.abs() < sa_tot.abs(), sa_new, sa_tot)
            degenerate[g] = sigma_new == 0
        if self.clip is not None:
            adv = adv.clamp(-self.clip, self.clip)
        return adv, _stats(adv, degenerate)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: every prompt's `[visits, mu_tot, sigma_tot]`."""
        return {"prompts": {p: list(v) for p, v in self.prompts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`."""
        self.prompts = {p: (int(v[0]), float(v[1]), float(v[2])) for p, v in state["prompts"].items()}


@ADVANTAGES.register("gae")
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: torch.Tensor,
    *,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438 eq. 16).

    `delta_t = r_t + gamma (1 - d_t) V(s_{t+1}) - V(s_t)`, `A_t = delta_t + gamma lam (1 - d_t) A_{t+1}`.

    Args:
        rewards, values, dones (`torch.Tensor`): `[B, T]`; `dones[:, t] = 1` when the episode ended at step t
            (no bootstrap across it).
        next_value (`torch.Tensor`): `[B]` value of the state after the last step.

    Returns:
        `(advantages[B, T], returns[B, T])` with `returns = advantages + values`.
    """
    if not (rewards.shape == values.shape == dones.shape) or rewards.ndim != 2:
        raise ValueError(
            f"rewards, values and dones must share a [B, T] shape, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(dones.shape)}"
        )
    if next_value.shape != rewards.shape[:1]:
        raise ValueError(f"next_value must be [B]={rewards.shape[0]}, got {tuple(next_value.shape)}")
    rewards, values, next_value = rewards.float(), values.float(), next_value.float()
    not_done = 1.0 - dones.float()
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):  # the recursion runs over time; batch is vectorised
        following = next_value if t == rewards.shape[1] - 1 else values[:, t + 1]
        delta = rewards[:, t] + gamma * not_done[:, t] * following - values[:, t]
        running = delta + gamma * lam * not_done[:, t] * running
        adv[:, t] = running
    return adv, adv + values


def normalize(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Batch whitening `(A - mean) / (std + eps)` with the sample (n - 1) std, as SB3's and CleanRL's PPO minibatch
    advantage normalisation."""
    return (adv - adv.mean()) / (adv.std() + eps)
