"""Per-token log-probabilities and entropies of completions under any `transformers` causal LM.

A text rollout's `[B, K]` tensor: row `i` is a prompt + completion, column `t` its t-th completion token. The
prompt is left-padded (generation batches are) and the completion right-padded, so every row's completion starts
at the same column of `input_ids`; the model sees position ids that skip the left padding. Logits are computed
for the completion positions only, in row chunks (`chunk_size`) to bound memory, and log-softmaxed in fp32.
`token_support_log_probs` also gathers each position's next-token support (the sampled token and the `top_k` most
likely others: TROLL's `[B, T, top_k + 1]` inputs) from the same forward.
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
    logps, entropies = [], []
    for ids, log_softmax in _completion_log_softmax(
        model, input_ids, attention_mask, completion_start, chunk_size, temperature
    ):
        logps.append(log_softmax.gather(-1, ids.unsqueeze(-1)).squeeze(-1))  # [b, T]
        if with_entropy:
            with torch.no_grad():
                entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))  # [b, T]
    return torch.cat(logps), torch.cat(entropies) if with_entropy else None


def _completion_log_softmax(model, input_ids, attention_mask, completion_start, chunk_size, temperature):
    """`(completion ids [b, T], fp32 log-softmax [b, T, V])` of each row chunk: the shared forward."""
    if not 0 < completion_start < input_ids.shape[1]:
        raise ValueError(f"completion_start must lie in (0, {input_ids.shape[1]}), got {completion_start}")
    rows = input_ids.shape[0]
    step = rows if chunk_size is None else max(1, chunk_size)
    for start in range(0, rows, step):
        ids, mask = input_ids[start : start + step], attention_mask[start : start + step]
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        # the logits at position j predict token j + 1: completion tokens P..P+T-1 come from positions P-1..P+T-2
        logits = logits[:, completion_start - 1 : -1].float() / temperature  # [b, T, V]
        yield ids[:, completion_start:], torch.log_softmax(logits, dim=-1)


def support_ids(log_softmax: torch.Tensor, tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    """`[b, T, top_k + 1]` TROLL's support of each position: the sampled token first, then the `top_k` most likely
    other tokens of `log_softmax [b, T, V]` (most likely first); `top_k` is capped at V - 1."""
    k = min(top_k, log_softmax.shape[-1] - 1)
    top = log_softmax.topk(k + 1, dim=-1).indices  # [b, T, k + 1]
    # drop the sampled token from the top k + 1 (a stable sort moves it last), keep the first k
    is_sampled = (top == tokens.unsqueeze(-1)).to(torch.int8)
    others = top.gather(-1, torch.sort(is_sampled, dim=-1, stable=True).indices)[..., :k]
    return torch.cat([tokens.unsqueeze(-1), others], dim=-1)


def token_support_log_probs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_start: int,
    *,
    top_k: int = 0,
    ids: torch.Tensor | None = None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`(log_probs [B, T], entropy or None, support ids [B, T, V], support log-probs [B, T, V])` for TROLL.

    The support is `ids` when given (the behaviour policy's, gathered again under the trained weights), else built
    from this forward: the sampled token and the `top_k` most likely others (`support_ids`, V = top_k + 1). One
    forward as `token_log_probs`; the gather adds `[B, T, V]` to it. Gradients flow when enabled.
    """
    logps, entropies, supports, support_logps = [], [], [], []
    start = 0
    for tokens, log_softmax in _completion_log_softmax(
        model, input_ids, attention_mask, completion_start, chunk_size, temperature
    ):
        b = tokens.shape[0]
        support = support_ids(log_softmax.detach(), tokens, top_k) if ids is None else ids[start : start + b]
        start += b
        supports.append(support)
        support_logps.append(log_softmax.gather(-1, support.to(log_softmax.device)))  # [b, T, V]
        logps.append(support_logps[-1][..., 0])  # column 0 is the sampled token
        if with_entropy:
            with torch.no_grad():
                entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))  # [b, T]
    entropy = torch.cat(entropies) if with_entropy else None
    return torch.cat(logps), entropy, torch.cat(supports), torch.cat(support_logps)
