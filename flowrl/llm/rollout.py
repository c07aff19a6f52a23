"""The text modality's rollout: k completions per prompt, as token ids with the behaviour log-probabilities."""

from __future__ import annotations

import dataclasses

import torch

from flowrl.policies.rollout import Record, per_sample


SENTENCE_END = (".", "!", "?", "\n")
"""A token whose text ends with one of these closes a sentence (SSPO's segments)."""


@dataclasses.dataclass
class TokenRollout(Record):
    """`B` prompt + completion rows. Prompts are left-padded and completions right-padded, so every completion
    starts at column `P` of `input_ids`; `K = T` is the completion length of the batch."""

    prompt_ids: torch.Tensor = per_sample()
    """`[B, P]` left-padded prompt tokens."""
    prompt_mask: torch.Tensor = per_sample()
    """`[B, P]` 1 on prompt tokens, 0 on padding."""
    completion_ids: torch.Tensor = per_sample()
    """`[B, T]` sampled tokens, right-padded after the end-of-sequence token."""
    completion_mask: torch.Tensor = per_sample()
    """`[B, T]` bool, True on the generated tokens up to and including the end-of-sequence token."""
    completions: list[str] = per_sample()
    """`[B]` decoded completions (special tokens dropped): what the rewards read."""
    segment_ids: torch.Tensor = per_sample()
    """`[B, T]` sentence index of each completion token (`SENTENCE_END`), for segment-level objectives."""
    log_probs: torch.Tensor | None = per_sample(default=None)
    """`[B, T]` fp32 behaviour log-probabilities (computed after sampling, in training-sized chunks)."""
    ref_log_probs: torch.Tensor | None = per_sample(default=None)
    """`[B, T]` the reference model's log-probabilities (only with a KL penalty)."""
    support_ids: torch.Tensor | None = per_sample(default=None)
    """`[B, T, V]` TROLL's next-token support of each completion token: the sampled token (column 0) and the
    behaviour policy's `top_k` most likely others (only for objectives that read `topk_logp`)."""
    support_log_probs: torch.Tensor | None = per_sample(default=None)
    """`[B, T, V]` fp32 behaviour log-probabilities of the support tokens."""

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask.long(), self.completion_mask.long()], dim=1)

    @property
    def mask(self) -> torch.Tensor:
        return self.completion_mask.bool()


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """`[B, T]` True up to and including each row's first end-of-sequence token (all True without one)."""
    if eos_token_id is None:
        return torch.ones_like(completion_ids, dtype=torch.bool)
    is_eos = completion_ids == eos_token_id
    before = is_eos.long().cumsum(-1) - is_eos.long()  # end-of-sequence tokens strictly before t
    return before == 0


def sentence_ids(token_texts: list[list[str]], width: int) -> torch.Tensor:
    """`[B, width]` segment index: it increases after each token whose text ends a sentence."""
    out = torch.zeros(len(token_texts), width, dtype=torch.long)
    for i, pieces in enumerate(token_texts):
        seg = 0
        for t, piece in enumerate(pieces[:width]):
            out[i, t] = seg
            if piece.endswith(SENTENCE_END):
                seg += 1
    return out
