"""Collecting an epoch of text: k sampled completions per prompt, their behaviour log-probs and rewards; and the
held-out evaluation (greedy or sampled completions of the test prompts, scored by the same reward callables)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flowrl.llm.rollout import TokenRollout
from flowrl.trainers.collect import Collected, epoch_prompts
from flowrl.trainers.scoring import Rewards
from flowrl.trainers.state import Processes, seeded


class TextCollector:
    """An epoch of completions and their rewards.

    Args:
        generate (`Callable`): `generate(texts, generator) -> TokenRollout` (without log-probs): one sampling call.
        behaviour (`Callable`): `behaviour(rollout) -> TokenRollout` with `log_probs` (and reference log-probs).
        rewards (`Rewards`): the training rewards, `reward(completions, prompts, **metadata) -> [B]`.
        processes (`Processes`): this process's share of the epoch's prompts.
        train_prompts (`list`): the training prompts (`prompts.Prompt`s: text and metadata such as the answer).
        prompts_per_epoch, group_size (`int`): m distinct prompts per epoch, k completions each.
        batch_size (`int`): rows per `generate` call.
        seed (`int`): `run.seed`.
    """

    def __init__(self, *, generate: Callable, behaviour: Callable, rewards: Rewards, processes: Processes,
                 train_prompts: list, prompts_per_epoch: int, group_size: int, batch_size: int,
                 seed: int):  # fmt: skip
        if not train_prompts:
            raise ValueError("the training prompt set is empty")
        self.generate, self.behaviour, self.rewards, self.processes = generate, behaviour, rewards, processes
        self.train_prompts, self.m, self.k = train_prompts, prompts_per_epoch, group_size
        self.batch_size, self.seed = batch_size, seed

    @torch.no_grad()
    def collect(self, epoch: int) -> Collected:
        start = time.time()
        prompts = epoch_prompts(self.train_prompts, self.m, self.k, self.seed, epoch)
        local = self.processes.local_slice(len(prompts))
        mine = prompts[local]
        generator = batch_stream(seeded(self.seed, epoch, 2, 0), local.start, self.batch_size)
        parts = [self.generate([str(p) for p in mine[i : i + self.batch_size]], generator)
                 for i in range(0, len(mine), self.batch_size)]  # fmt: skip
        rollout = pad_cat(parts)
        t0 = time.time()
        rollout = self.behaviour(rollout)
        t1 = time.time()
        rewards = self.rewards.score(rollout.completions, mine)
        times = {"time/sample_s": t0 - start, "time/behaviour_s": t1 - t0, "time/reward_s": time.time() - t1}
        return Collected(rollout, prompts, local, rewards, times)


def batch_stream(generator: torch.Generator, start: int, batch_size: int) -> torch.Generator:
    """`generator` as the process whose share starts at row `start` continues it: each `generate` call of
    `batch_size` rows draws one seed from it, so the calls of the earlier rows' batches are skipped. When every
    process's share is a multiple of `batch_size`, each batch of prompts is sampled from the same seed on one
    process or many (sampling draws from a batch-wide stream: a prompt's completion depends on its batch)."""
    for _ in range(start // batch_size):
        torch.randint(2**62, (1,), generator=generator)  # what `_generate_ids` draws per call
    return generator


def pad_cat(parts: list[TokenRollout], pad_id: int = 0) -> TokenRollout:
    """One rollout from generation batches of different prompt / completion widths (left / right padding)."""
    width_p = max(p.prompt_ids.shape[1] for p in parts)
    width_t = max(p.completion_ids.shape[1] for p in parts)

    def left(x, width, value):
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    def right(x, width, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    padded = [
        TokenRollout(
            prompt_ids=left(p.prompt_ids, width_p, pad_id),
            prompt_mask=left(p.prompt_mask, width_p, 0),
            completion_ids=right(p.completion_ids, width_t, pad_id),
            completion_mask=right(p.completion_mask, width_t, False),
            completions=p.completions,
            segment_ids=right(p.segment_ids, width_t, 0),
        )  # fmt: skip
        for p in parts
    ]
    return TokenRollout.cat(padded)


class TextEvaluator:
    """The test prompts' completions (greedy, or `samples` sampled from the evaluation seed) scored by every
    training reward (`eval/<name>`, `eval/reward` their weighted sum) and the extra metrics; also the mean
    completion length in tokens."""

    def __init__(self, *, complete: Callable, rewards: Rewards, extra: dict, prompts: list, greedy: bool,
                 samples: int, seed: int, batch_size: int):  # fmt: skip
        if not prompts:
            raise ValueError("the test prompt set is empty")
        self.complete, self.rewards, self.extra, self.prompts = complete, rewards, extra, prompts
        self.greedy, self.samples, self.seed, self.batch_size = greedy, samples, seed, batch_size

    @torch.no_grad()
    def evaluate(self) -> dict:
        repeats = 1 if self.greedy else self.samples
        prompts = [p for p in self.prompts for _ in range(repeats)]
        local = self.rewards.processes.local_slice(len(prompts))
        mine = prompts[local]
        generator = batch_stream(torch.Generator().manual_seed(self.seed), local.start, self.batch_size)
        completions, lengths = [], []
        for i in range(0, len(mine), self.batch_size):
            texts, length = self.complete([str(p) for p in mine[i : i + self.batch_size]], generator, self.greedy)
            completions += texts
            lengths.append(length)
        scores = self.rewards.score(completions, mine, {**self.rewards.fns, **self.extra})
        length = self.rewards.processes.gather(torch.cat(lengths).float()).mean()
        out = {f"eval/{name}": float(v.float().nanmean()) for name, v in scores.items()}
        out["eval/reward"] = float(self.rewards.combined({k: scores[k] for k in self.rewards.fns}).nanmean())
        out["eval/completion_tokens"] = float(length)
        return out
