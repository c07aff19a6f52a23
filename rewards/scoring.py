"""The run's reward models, for every modality: scored on this process, gathered, checked, combined.

`Rewards` is what collectors and evaluators score with (images, completions); `call_reward` names a reward that
fails; `texts_and_metadata` turns `Prompt`s into the texts and per-sample metadata rewards read.
"""

from __future__ import annotations

from functools import partial

import torch

from flowrl.rewards import RewardError, check_output
from flowrl.rewards.multi import weighted_sum
from flowrl.runtime import Processes


def texts_and_metadata(prompts: list) -> tuple[list[str], dict[str, list]]:
    """Prompt texts and their metadata as per-sample lists (`Prompt` objects or plain strings)."""
    texts = [str(p) for p in prompts]
    keys = dict.fromkeys(k for p in prompts for k in getattr(p, "metadata", {}))
    return texts, {k: [getattr(p, "metadata", {}).get(k) for p in prompts] for k in keys}


def source_kwargs(fn, sources) -> dict:
    """`{"source_images": sources}` for a reward that asks for them (`needs_source_images`), else nothing."""
    if sources is None or not getattr(fn, "needs_source_images", False):
        return {}
    return {"source_images": sources}


def call_reward(name: str, run, n: int) -> torch.Tensor:
    """The checked `[n]` scores that `run()` returns (a reward call, or a future's `result`); a failure of the
    reward is a `RewardError` that names it."""
    try:
        scores = run()
    except RewardError:
        raise
    except Exception as err:  # noqa: BLE001  (a reward's own failure, whatever its kind, is named and kept)
        raise RewardError(f"reward {name!r} failed: {type(err).__name__}: {err}") from err
    return check_output(name, scores, n)


class Rewards:
    """The run's training rewards: scored per process, gathered, checked and combined.

    Args:
        fns (`dict[str, Callable]`): reward name -> `reward(outputs, prompts, **metadata) -> [B]`.
        weights (`dict[str, float]`): reward name -> weight in the combined reward (0: logged only).
        processes (`Processes`): for gathering.
        max_bad_frac (`float`): an epoch with more NaN/inf rewards than this fraction aborts.
    """

    def __init__(self, fns: dict, weights: dict[str, float], processes: Processes, max_bad_frac: float = 0.1):
        unknown = sorted(set(weights) - set(fns))
        if unknown:
            raise ValueError(f"no reward function for {unknown}")
        self.fns, self.weights, self.processes, self.max_bad_frac = fns, weights, processes, max_bad_frac

    def score(self, outputs, prompts: list, fns: dict | None = None, sources=None) -> dict[str, torch.Tensor]:
        """Each reward on this process's outputs (prompt metadata as keyword arguments), gathered: `{name: [N]}`.

        `sources` (editing: the rollout's `source_images [B, N, 3, H, W]`) go to the rewards that ask for them.
        """
        texts, metadata = texts_and_metadata(prompts)
        return {
            name: self.processes.gather(
                call_reward(name, partial(fn, outputs, texts, **metadata, **source_kwargs(fn, sources)), len(texts))
            )
            for name, fn in (fns or self.fns).items()
        }

    def combined(self, rewards: dict[str, torch.Tensor]) -> torch.Tensor:
        """The weighted sum of the training rewards."""
        return weighted_sum(rewards, self.weights, len(next(iter(rewards.values()))))

    def check(self, rewards: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Valid-sample mask (finite under every reward) and counts (with each reward's own counters,
        `reward_metrics`); aborts past `max_bad_frac`."""
        valid = torch.ones_like(next(iter(rewards.values())), dtype=torch.bool)
        bad = {}
        for name, r in rewards.items():
            finite = torch.isfinite(r)
            bad[name] = int((~finite).sum())
            valid &= finite
        frac = 1 - valid.float().mean().item()
        if frac > self.max_bad_frac:
            detail = ", ".join(f"{name}: {count}" for name, count in bad.items() if count)
            raise RuntimeError(
                f"{frac:.0%} of this epoch's rewards are NaN/inf ({detail} of {len(valid)} samples), more than "
                f"run.max_bad_reward_frac={self.max_bad_frac}; check the reward model(s)"
            )
        return valid, {
            "bad_rewards": int((~valid).sum()),
            **{f"bad_rewards/{k}": v for k, v in bad.items() if v},
            **reward_metrics(self.fns),
        }


def reward_metrics(fns: dict) -> dict[str, float]:
    """`reward/<name>/<counter>` of every reward that keeps counters (`pop_metrics() -> {counter: value}`, e.g. the
    VLM judges' requests, cache hits, retries, unparsable answers, failures): this process's, since the last call."""
    out = {}
    for name, fn in fns.items():
        pop = getattr(fn, "pop_metrics", None)
        if callable(pop):
            out.update({f"reward/{name}/{key}": float(value) for key, value in pop().items()})
    return out


def reward_summary(rewards: dict[str, torch.Tensor], total: torch.Tensor, valid: torch.Tensor) -> dict:
    """An epoch's reward statistics over its valid samples: `reward/mean`, `reward/std` (the weighted sum) and
    `reward/<name>` (each reward's mean)."""
    kept = total[valid]
    return {
        "reward/mean": kept.mean() if len(kept) else float("nan"),
        "reward/std": kept.std() if len(kept) > 1 else 0.0,
        **{f"reward/{name}": r[valid].mean() for name, r in rewards.items()},
    }
