"""Pref-GRPO's reward: each sample's win rate against the other samples of its prompt's group.

Pref-GRPO (Wang et al. 2025, arXiv:2508.20751; CodeGoat24/Pref-GRPO `unifiedreward_think.py::cal_win_rate_images`)
replaces pointwise scores by pairwise preferences: for the G samples of a prompt, every unordered pair (i, j),
i < j, is judged once with sample i shown first, and

    w_i = (1 / (G - 1)) sum_{j != i} [ P(i > j) ],   P = 1 (win), 0 (loss), 1/2 (tie or no verdict)

so the win rates of a group sum to G / 2 and spread over [0, 1], where pointwise scores often differ by tiny
amounts that a group z-score would blow up into large advantages. `PairwiseWinRate` wraps any pairwise judge, or
turns any pointwise reward into one (`score=`: the higher score wins, equal scores tie), into such a reward;
the trainer's group advantages then apply as for any reward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flowrl.rewards import _import, check_output, get, register


def win_rates(pair_first: torch.Tensor, pair_second: torch.Tensor, p_first: torch.Tensor, group_sizes: torch.Tensor):
    """`[B]` win rates from `n` judged pairs: `p_first [n]` = P(first > second) in [0, 1]; samples of a
    one-sample group get 1/2."""
    wins = torch.zeros(group_sizes.shape[0], dtype=torch.float64)
    wins.index_add_(0, pair_first, p_first.double())
    wins.index_add_(0, pair_second, 1 - p_first.double())
    opponents = (group_sizes - 1).double()
    return torch.where(opponents > 0, wins / opponents.clamp_min(1), 0.5).float()


def score_judge(scores: torch.Tensor, first: torch.Tensor, second: torch.Tensor, tie_margin: float = 0.0):
    """P(first > second) from pointwise scores: 1 if higher by more than `tie_margin`, 0 if lower, else 1/2."""
    diff = scores[first] - scores[second]
    return torch.where(diff > tie_margin, 1.0, torch.where(diff < -tie_margin, 0.0, 0.5))


@register("pairwise_winrate")
class PairwiseWinRate:
    """In-group win rates from a pairwise judge or a pointwise reward (needs: what the judge or reward needs).

    Samples are grouped by prompt text within one call, so a call must hold whole groups (flowrl's collector
    scores each process's samples at once; keep `sampling.reward_overlap: 1`).

    Args:
        judge (`str` or `Callable`, *optional*): `judge(first [n, 3, H, W], second [n, 3, H, W], prompts [n]) ->
            [n]` P(first is better) in [0, 1] (1, 0, or 1/2 for a tie); a dotted path `package.module:attribute`
            or a callable. A VLM judge served elsewhere goes here.
        score (`str`, *optional*): a pointwise reward (a registered name or dotted path) turned into the judge
            "the higher score wins" (`tie_margin` apart, else a tie); it is scored once per sample, not per pair.
        both_orders (`bool`, defaults to `False`): judge every pair in both orders and average `(P(i > j) + 1 -
            P(j > i)) / 2`, cancelling a judge's position bias (Pref-GRPO shows sample i first only).
        tie_margin (`float`, defaults to 0): scores closer than this tie (`score=` only).
        **kwargs: constructor kwargs of the `score` reward (or of the judge, when `judge` is a factory path).
    """

    differentiable = False

    def __init__(
        self,
        judge: str | Callable | None = None,
        score: str | None = None,
        both_orders: bool = False,
        tie_margin: float = 0.0,
        **kwargs: Any,
    ):
        if (judge is None) == (score is None):
            raise ValueError("pairwise_winrate needs exactly one of judge= (a pairwise judge) or score= (a reward)")
        if tie_margin < 0:
            raise ValueError(f"tie_margin must be >= 0, got {tie_margin}")
        self.both_orders, self.tie_margin = both_orders, tie_margin
        self.scorer = get(score, **kwargs) if score is not None else None
        if isinstance(judge, str):
            judge = _import(judge)
            judge = judge(**kwargs) if kwargs else judge
        self.judge = judge

    def pairs(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(first [n], second [n], group_sizes [B])`: every unordered pair i < j of samples with the same prompt."""
        groups: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(prompt, []).append(i)
        first, second = [], []
        sizes = torch.zeros(len(prompts), dtype=torch.long)
        for members in groups.values():
            sizes[members] = len(members)
            for a, i in enumerate(members):
                for j in members[a + 1 :]:
                    first.append(i)
                    second.append(j)
        return torch.tensor(first, dtype=torch.long), torch.tensor(second, dtype=torch.long), sizes

    def __call__(self, images: torch.Tensor, prompts, **metadata) -> torch.Tensor:
        prompts = [str(p) for p in prompts]
        if len(prompts) != images.shape[0]:
            raise ValueError(f"reward {self.name!r} got {images.shape[0]} images but {len(prompts)} prompts")
        first, second, sizes = self.pairs(prompts)
        if self.scorer is not None:
            scores = check_output(self.name, self.scorer(images, prompts, **metadata), len(prompts)).double()
            p = score_judge(scores, first, second, self.tie_margin)
        else:
            p = self._judge(images, prompts, first, second)
            if self.both_orders:
                p = (p + 1 - self._judge(images, prompts, second, first)) / 2
        return check_output(self.name, win_rates(first, second, p, sizes), len(prompts))

    def _judge(self, images, prompts, first, second) -> torch.Tensor:
        if first.numel() == 0:
            return torch.zeros(0)
        out = self.judge(images[first], images[second], [prompts[i] for i in first.tolist()])
        p = torch.as_tensor(out, dtype=torch.float64).flatten().cpu()
        if p.shape[0] != first.shape[0] or not bool(((p >= 0) & (p <= 1)).all()):
            raise ValueError(
                f"the pairwise judge must return {first.shape[0]} probabilities in [0, 1], got shape {tuple(p.shape)}"
            )
        return p
