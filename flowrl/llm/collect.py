"""Collecting an epoch of text: k sampled completions per prompt and their rewards; and the held-out evaluation
(greedy or sampled completions of the test prompts, scored by the same reward callables).

Every completion is sampled from its own generator, seeded by its position in the epoch's prompt list
(`flowrl.llm.policy.RowSampler`), so an epoch's completions are the same on one process or many and for any
`batch.micro_batch_size`. The collector returns a typed `Collected` batch without behaviour log-probs (the
algorithm adds them) and never calls into the trainer.
"""

from __future__ import annotations

import time

import torch

from flowrl.llm.policy import TextPolicy, completions
from flowrl.llm.rollout import TokenRollout
from flowrl.policies.rollout import Collected
from flowrl.prompts import epoch_prompts
from flowrl.rewards import Rewards
from flowrl.runtime import Processes, row_generators


class TextCollector:
    """An epoch of completions and their rewards.

    Args:
        policy (`TextPolicy`): the model and tokenizer; `model` is what samples (the prepared module unwrapped).
        generation (`GenerationConfig`): length, temperature, top-k.
        rewards (`Rewards`): the training rewards, `reward(completions, prompts, **metadata) -> [B]`.
        processes (`Processes`): this process's share of the epoch's prompts.
        train_prompts (`list`): the training prompts (`prompts.Prompt`s: text and metadata such as the answer).
        prompts_per_epoch, group_size (`int`): m distinct prompts per epoch, k completions each.
        batch_size (`int`): rows per `generate` call (`batch.micro_batch_size`).
        seed (`int`): `run.seed`.
        segments (`bool`): also split completions into sentences (segment-level objectives).
    """

    def __init__(
        self,
        *,
        policy: TextPolicy,
        model,
        generation,
        rewards: Rewards,
        processes: Processes,
        train_prompts: list,
        prompts_per_epoch: int,
        group_size: int,
        batch_size: int,
        seed: int,
        segments: bool = False,
    ):
        if not train_prompts:
            raise ValueError("the training prompt set is empty")
        self.policy, self.model, self.generation, self.rewards = policy, model, generation, rewards
        self.processes, self.train_prompts, self.m, self.k = processes, train_prompts, prompts_per_epoch, group_size
        self.batch_size, self.seed, self.segments = batch_size, seed, segments

    @torch.no_grad()
    def collect(self, epoch: int) -> Collected:
        start = time.time()
        prompts = epoch_prompts(self.train_prompts, self.m, self.k, self.seed, epoch)
        local = self.processes.local_slice(len(prompts))
        mine = prompts[local]
        self.model.eval()
        parts = []
        for i in range(0, len(mine), self.batch_size):
            rows = range(local.start + i, local.start + min(i + self.batch_size, len(mine)))
            generators = row_generators((self.seed, epoch, 2), rows)
            texts = [str(p) for p in mine[i : i + self.batch_size]]
            parts.append(
                completions(self.policy, self.model, texts, generators, self.generation, segments=self.segments)
            )
        rollout = pad_cat(parts)
        sampled = time.time()
        rewards = self.rewards.score(rollout.completions, mine)
        times = {"time/sample_s": sampled - start, "time/reward_s": time.time() - sampled}
        return Collected(
            data=rollout,
            rows=torch.arange(local.start, local.stop),
            size=len(prompts),
            prompts=prompts,
            rewards=rewards,
            total=self.rewards.combined(rewards),
            times=times,
        )


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
        )
        for p in parts
    ]
    return TokenRollout.cat(padded)


class TextEvaluator:
    """The test prompts' completions (greedy, or `samples` sampled from the evaluation seed, one generator per
    completion) scored by every training reward (`eval/<name>`, `eval/reward` their weighted sum) and the extra
    metrics; also the mean completion length in tokens."""

    def __init__(
        self,
        *,
        policy: TextPolicy,
        model,
        generation,
        rewards: Rewards,
        extra: dict,
        prompts: list,
        greedy: bool,
        samples: int,
        seed: int,
        batch_size: int,
    ):
        if not prompts:
            raise ValueError("the test prompt set is empty")
        self.policy, self.model, self.generation = policy, model, generation
        self.rewards, self.extra, self.prompts = rewards, extra, prompts
        self.greedy, self.samples, self.seed, self.batch_size = greedy, samples, seed, batch_size

    @torch.no_grad()
    def evaluate(self) -> dict:
        repeats = 1 if self.greedy else self.samples
        prompts = [p for p in self.prompts for _ in range(repeats)]
        processes = self.rewards.processes
        padded = prompts + prompts[: (-len(prompts)) % processes.world]
        local = processes.local_slice(len(padded))
        mine = padded[local]
        texts, lengths = [], []
        for i in range(0, len(mine), self.batch_size):
            rows = range(local.start + i, local.start + min(i + self.batch_size, len(mine)))
            generators = None if self.greedy else row_generators((self.seed,), rows)
            part = completions(
                self.policy, self.model, [str(p) for p in mine[i : i + self.batch_size]], generators, self.generation
            )
            texts += part.completions
            lengths.append(part.completion_mask.sum(-1))
        fns = {**self.rewards.fns, **self.extra}
        scores = {k: v[: len(prompts)] for k, v in self.rewards.score(texts, mine, fns).items()}
        length = processes.gather(torch.cat(lengths).float())[: len(prompts)].mean()
        out = {f"eval/{name}": float(v.float().nanmean()) for name, v in scores.items()}
        out["eval/reward"] = float(self.rewards.combined({k: scores[k] for k in self.rewards.fns}).nanmean())
        out["eval/completion_tokens"] = float(length)
        return out
