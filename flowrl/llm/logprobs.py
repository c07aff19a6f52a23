"""Per-token log-probabilities and entropies of completions under any `transformers` causal LM.

A text rollout's `[B, K]` tensor: row `i` is a prompt + completion, column `t` its t-th completion token. The
prompt is left-padded (generation batches are) and the completion right-padded, so every row's completion starts
at the same column of `input_ids`; the model sees position ids that skip the left padding. Logits are computed
for the completion positions only, in row chunks (`chunk_size`) to bound memory, and log-softmaxed in fp32.
"""

from __future__ import annotations

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions `0, 1, ...` counted over the attended tokens of each row (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def token_log_probs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_start: int,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(log_probs [B, T], entropy [B, T] or None)` of the tokens `input_ids[:, completion_start:]`.

    Args:
        model: a causal LM (`model(input_ids, attention_mask, position_ids).logits`); gradients flow when enabled.
        input_ids (`torch.Tensor`): `[B, P + T]` left-padded prompts followed by right-padded completions.
        attention_mask (`torch.Tensor`): `[B, P + T]`, 0 on padding.
        completion_start (`int`): P, the column of the first completion token.
        chunk_size (`int`, *optional*): rows per forward call (None: all at once).
        temperature (`float`): logits are divided by it, as at sampling (the behaviour policy's density).
        with_entropy (`bool`): also return the entropy of each next-token distribution (no gradient).

    Padding positions hold finite values; the caller's mask removes them.
    """
    if not 0 < completion_start < input_ids.shape[1]:
        raise ValueError(f"completion_start must lie in (0, {input_ids.shape[1]}), got {completion_start}")
    rows = input_ids.shape[0]
    step = rows if chunk_size is None else max(1, chunk_size)
    logps, entropies = [], []
    for start in range(0, rows, step):
        ids, mask = input_ids[start : start + step], attention_mask[start : start + step]
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        # the logits at position j predict token j + 1: completion tokens P..P+T-1 come from positions P-1..P+T-2
        logits = logits[:, completion_start - 1 : -1].float() / temperature  # [b, T, V]
        log_softmax = torch.log_softmax(logits, dim=-1)
        target = ids[:, completion_start:]
        logps.append(log_softmax.gather(-1, target.unsqueeze(-1)).squeeze(-1))  # [b, T]
        if with_entropy:
            with torch.no_grad():
                entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))  # [b, T]
    return torch.cat(logps), torch.cat(entropies) if with_entropy else None
