"""Verifiable rewards for text: callables `reward(completions, prompts, **metadata) -> [B]` on decoded completions.

The prompt metadata (`prompts.Prompt.metadata`, e.g. a problem's `answer`) arrives as keyword arguments, one
entry per sample, as for the image rewards.
"""

from __future__ import annotations

import torch

from flowrl.rewards import register


@register(
    "arith_exact", description="1 when the completion's answer equals the prompt's `answer` exactly (toy arithmetic)"
)
class ArithExact:
    """Exact-match reward of the toy arithmetic task (`flowrl.llm.arith.parse_answer` reads the completion)."""

    def __call__(
        self, completions: list[str], prompts: list[str], answer: list[str] | None = None, **_
    ) -> torch.Tensor:
        if answer is None:
            raise ValueError(
                "arith_exact needs each prompt's `answer` in its metadata (the arith/... prompt sets have it)"
            )
        from flowrl.llm.arith import arith_reward

        return arith_reward(list(completions), [str(a) for a in answer])
