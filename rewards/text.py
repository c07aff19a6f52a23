"""Verifiable rewards for text: callables `reward(completions, prompts, **metadata) -> [B]` on decoded completions.

The prompt metadata (`prompts.Prompt.metadata`, e.g. a problem's `answer`) arrives as keyword arguments, one
entry per sample, as for the image rewards.
"""

from __future__ import annotations

import torch

from flowrl.rewards import register


END_MARKERS = ("\n", "<eos>")
"""An answer ends at the first of these in a completion (or at the end of the text): a newline or the toy
arithmetic tokenizer's end token (`flowrl.llm.arith.EOS`)."""


def parse_answer(completion: str) -> str:
    """The answer a completion gives: its text up to the first end marker ("\\n" or "<eos>"), stripped.

    The completion is the generated text only (not the prompt). Text after the first marker is ignored, so
    "68<eos><pad>" and "68\\n12+3=" both give "68"; text before it is not, so "68 12" gives "68 12" (and is
    wrong). Surrounding whitespace is stripped: " 68 " gives "68".
    """
    cut = len(completion)
    for marker in END_MARKERS:
        at = completion.find(marker)
        if at != -1:
            cut = min(cut, at)
    return completion[:cut].strip()


def arith_reward(completions: list[str], answers: list[str]) -> torch.Tensor:
    """Exact-match reward `[B]` float32: 1.0 where `parse_answer(completion) == answer.strip()`, else 0.0."""
    if isinstance(completions, str) or isinstance(answers, str):
        raise TypeError("arith_reward takes lists of completions and answers, not a single string")
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    hits = [parse_answer(c) == a.strip() for c, a in zip(completions, answers)]
    return torch.tensor(hits, dtype=torch.float32)  # [B]


@register(
    "arith_exact", description="1 when the completion's answer equals the prompt's `answer` exactly (toy arithmetic)"
)
class ArithExact:
    """Exact-match reward of the toy arithmetic task (`parse_answer` reads the completion)."""

    def __call__(
        self, completions: list[str], prompts: list[str], answer: list[str] | None = None, **_
    ) -> torch.Tensor:
        if answer is None:
            raise ValueError(
                "arith_exact needs each prompt's `answer` in its metadata (the arith/... prompt sets have it)"
            )
        return arith_reward(list(completions), [str(a) for a in answer])
