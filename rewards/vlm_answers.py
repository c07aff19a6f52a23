"""Reading the VLM judges' answers (`flowrl.rewards.vlm_judges`), pure functions: a 1-5 score after a pattern and
its scale, P(yes) from the first token's log-probabilities or yes/no from the text, a pairwise verdict, and the win
rates over the read verdicts.
"""

from __future__ import annotations

import math
import re

import torch

from flowrl.rewards.vlm_templates import FINAL_SCORE


ANSWERS = ("score", "yes_no")
SCALES = ("fraction", "unit", "raw")


def parse_score(text: str, pattern: str = FINAL_SCORE, score_range: tuple[float, float] = (1, 5)) -> float | None:
    """The number in the first match of `pattern` (its group 1) in `text`; None without a match or outside
    `score_range`."""
    match = re.search(pattern, text)
    if match is None:
        return None
    try:
        value = float(match.group(1))
    except (IndexError, ValueError):
        return None
    low, high = score_range
    return value if low <= value <= high and math.isfinite(value) else None


def scale_score(value: float, score_range: tuple[float, float] = (1, 5), scale: str = "fraction") -> float:
    """A parsed score on the reward's scale: `fraction` `x / high` (Flow-GRPO's `score / 5`, in [0.2, 1]), `unit`
    `(x - low) / (high - low)` (in [0, 1]), `raw` `x`."""
    low, high = score_range
    if scale == "fraction":
        return value / high
    if scale == "unit":
        return (value - low) / (high - low)
    if scale == "raw":
        return value
    raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")


def _word(token: str) -> str:
    return token.strip().lstrip("\u2581\u0120").strip().lower()  # sentencepiece / byte-level BPE space markers


def yes_probability(candidates, canonicalize: bool = True) -> float | None:
    """`P(yes) / (P(yes) + P(no))` from the first generated token's `(token, logprob)` candidates (Flow-Factory's
    `vllm_evaluate`).

    `canonicalize=True` sums the probabilities of every distinct token that reads `yes` (or `no`) once stripped of
    spaces and lower-cased (`Yes`, ` yes`, `YES`, ...); `False` reads only the tokens `Yes` and `No`. Computed as
    `sigmoid(logsumexp(yes) - logsumexp(no))`, exact for tiny probabilities. None when neither appears.
    """
    seen: dict[str, float] = {}
    for token, logprob in candidates:
        seen.setdefault(token, float(logprob))
    if canonicalize:
        yes = [lp for t, lp in seen.items() if _word(t) == "yes"]
        no = [lp for t, lp in seen.items() if _word(t) == "no"]
    else:
        yes = [seen["Yes"]] if "Yes" in seen else []
        no = [seen["No"]] if "No" in seen else []
    log_yes = torch.logsumexp(torch.tensor(yes, dtype=torch.float64), 0).item() if yes else -math.inf
    log_no = torch.logsumexp(torch.tensor(no, dtype=torch.float64), 0).item() if no else -math.inf
    if log_yes == -math.inf and log_no == -math.inf:
        return None
    if log_no == -math.inf or log_yes == -math.inf:
        return 1.0 if log_no == -math.inf else 0.0
    return 1.0 / (1.0 + math.exp(min(log_no - log_yes, 700.0)))


def yes_no_text(text: str) -> float | None:
    """1 when the answer's first word is yes, 0 when it is no (any case, punctuation ignored), else None."""
    match = re.match(r"\W*([A-Za-z]+)", text)
    word = match.group(1).lower() if match else ""
    return 1.0 if word == "yes" else 0.0 if word == "no" else None


def parse_preference(text: str) -> float | None:
    """P(first better) from a pairwise verdict: 1 for "Image 1 is better" (or "Video 1 ..."), 0 for "... 2 is better",
    read inside `<answer>...</answer>` when present (Pref-GRPO's UnifiedReward-Think format), else in the whole text;
    None without a verdict or with both."""
    tagged = re.search(r"<answer>(.*?)</answer>", text, flags=re.S | re.I)
    verdicts = set(re.findall(r"(?:image|video)\s*([12])\s+is\s+better", tagged.group(1) if tagged else text, re.I))
    if len(verdicts) != 1:
        return None
    return 1.0 if verdicts == {"1"} else 0.0


def win_rates_of_read(first: torch.Tensor, second: torch.Tensor, p_first: torch.Tensor, group_sizes: torch.Tensor):
    """`[B]` win rates over the read verdicts: `p_first [n]` = P(first > second) in [0, 1] or NaN (unread, left out);
    NaN for a sample whose every verdict is unread, 1/2 for a one-sample group. Equal to
    `flowrl.rewards.pairwise.win_rates` when every verdict is read."""
    read = torch.isfinite(p_first)
    first, second, p = first[read], second[read], p_first[read].double()
    wins = torch.zeros(group_sizes.shape[0], dtype=torch.float64)
    wins.index_add_(0, first, p).index_add_(0, second, 1 - p)
    seen = torch.zeros_like(wins)
    seen.index_add_(0, first, torch.ones_like(p)).index_add_(0, second, torch.ones_like(p))
    rates = torch.where(seen > 0, wins / seen.clamp_min(1), torch.tensor(math.nan, dtype=torch.float64))
    return torch.where(group_sizes > 1, rates, 0.5).float()
