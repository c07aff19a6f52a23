"""A causal LM as a text policy: loading it, sampling completions row by row, and its prompt sets.

Sampling draws each completion's tokens from its own generator (one per row, seeded by the row's position in the
epoch): at step `t` a row takes the token where its uniform `u_t` falls in the cumulative tempered (top-k) next-token
distribution (inverse-CDF sampling, exactly a draw from that distribution). A completion therefore does not depend
on what it was batched with, nor on how many processes share the epoch, up to the floating-point rounding of the
logits. `transformers`' `generate` runs the loop (caching, padding, stopping); the draw is a logits processor that
leaves one token possible, which greedy decoding then takes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl import prompts as prompt_sets
from flowrl.llm.rollout import TokenRollout, completion_mask, sentence_ids


class TextPolicy:
    """The causal LM, its tokenizer, and the frozen reference for a KL penalty (None without one)."""

    def __init__(self, model, tokenizer, reference=None):
        self.model, self.tokenizer, self.reference = model, tokenizer, reference

    @property
    def has_lora(self) -> bool:
        return bool(getattr(self.model, "peft_config", None))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def load_causal_lm(name: str, dtype: str = "fp32"):
    """`(model, tokenizer)`: the toy `arith` LM (built and cached on first use) or a local causal-LM folder."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if name == "arith":
        from flowrl.llm.build import build, load

        model, tokenizer = load(build())
        return model.to(torch_dtype), tokenizer
    if not Path(name).is_dir():
        raise FileNotFoundError(
            f"model.name {name!r} is neither 'arith' nor a local folder with a causal LM and "
            "its tokenizer (flowrl does not download models at run time)"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype)
    return model, AutoTokenizer.from_pretrained(name)


def build_text_policy(model_config, *, seed: int, reference: bool = False) -> TextPolicy:
    """The `TextPolicy` of a `model` section: LoRA (peft) or every weight trains; `reference` keeps a frozen copy
    for a KL when every weight trains (a LoRA run's reference is the model with the adapter disabled)."""
    import copy

    m = model_config
    torch.manual_seed(seed)
    model, tokenizer = load_causal_lm(m.name, m.dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    frozen = copy.deepcopy(model).eval().requires_grad_(False) if reference and not m.lora_rank else None
    if m.lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=m.lora_rank, lora_alpha=m.lora_alpha or m.lora_rank, target_modules=m.lora_targets, lora_dropout=0.0
        )
        model = get_peft_model(model, lora)
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return TextPolicy(model, tokenizer, frozen)


def load_text_prompts(name: str, *, count: int = 4000) -> list:
    """`arith/train`, `arith/test` (problems with their `answer` in the metadata) or any prompt set / file."""
    if name.startswith("arith/"):
        from flowrl.llm.arith import SPLITS, make_problems

        split = name.split("/", 1)[1]
        if split not in SPLITS:
            raise ValueError(
                f"unknown arith prompt set {name!r}; choose from {', '.join(f'arith/{s}' for s in SPLITS)}"
            )
        problems = make_problems(count if split == "train" else count // 4, seed=0, split=split)
        return [prompt_sets.Prompt(p.prompt, {"answer": p.answer}) for p in problems]
    return prompt_sets.load(name)


class RowSampler:
    """A `transformers` logits processor that samples each row's next token from its own uniform draws.

    Args:
        uniforms (`torch.Tensor`): `[B, T]` one uniform per row and generation step.
        prompt_length (`int`): the (left-padded) prompt width: step `t` is `input_ids.shape[1] - prompt_length`.
        temperature (`float`), top_k (`int`): the tempered, truncated distribution the tokens come from.
    """

    def __init__(self, uniforms: torch.Tensor, prompt_length: int, temperature: float = 1.0, top_k: int = 0):
        self.uniforms, self.prompt_length = uniforms, prompt_length
        self.temperature, self.top_k = temperature, top_k

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_length
        logits = scores.float() / self.temperature  # [B, V]
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -torch.inf)
        cdf = torch.softmax(logits, dim=-1).cumsum(-1)  # [B, V]
        u = self.uniforms[:, step].to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]  # [B, 1], inside the total mass
        u = u.clamp_min(torch.finfo(cdf.dtype).tiny)  # u > 0: the first token reached has positive probability
        token = torch.searchsorted(cdf, u).clamp_max(cdf.shape[-1] - 1)  # [B, 1]
        chosen = torch.full_like(scores, -torch.inf)
        return chosen.scatter(1, token, 0.0)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    texts: list[str],
    generators: list[torch.Generator] | None,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    device=None,
):
    """`(prompt batch, completion ids [B, T])` of `texts`: sampled row by row from `generators` (one per row), or
    greedy with `generators` None."""
    from transformers import LogitsProcessorList

    batch = tokenizer(texts, padding=True, return_tensors="pt").to(device or model.device)
    prompt_length = batch["input_ids"].shape[1]
    processors = None
    if generators is not None:
        uniforms = torch.stack([torch.rand(max_new_tokens, generator=g) for g in generators])  # [B, T]
        processors = LogitsProcessorList([RowSampler(uniforms, prompt_length, temperature, top_k)])
    out = model.generate(
        **batch,
        do_sample=False,
        temperature=None,
        top_k=None,
        top_p=None,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        logits_processor=processors,
    )
    return batch, out[:, prompt_length:]


def completions(
    policy: TextPolicy, model, texts: list[str], generators, generation, *, device=None, segments: bool = False
) -> TokenRollout:
    """A rollout (without log-probs) of `texts`' completions by `model`, sampled (`generators`) or greedy (None)."""
    tok = policy.tokenizer
    batch, completion = generate(
        model,
        tok,
        texts,
        generators,
        max_new_tokens=generation.max_new_tokens,
        temperature=generation.temperature,
        top_k=generation.top_k,
        device=device,
    )
    mask = completion_mask(completion, tok.eos_token_id)
    completion = torch.where(mask, completion, tok.pad_token_id)
    decoded = tok.batch_decode(completion, skip_special_tokens=True)
    segment_ids = torch.zeros_like(completion)
    if segments:
        pieces = [[tok.decode([t]) for t in row[m].tolist()] for row, m in zip(completion, mask)]
        segment_ids = sentence_ids(pieces, completion.shape[1])
    return TokenRollout(
        prompt_ids=batch["input_ids"],
        prompt_mask=batch["attention_mask"].bool(),
        completion_ids=completion,
        completion_mask=mask,
        completions=decoded,
        segment_ids=segment_ids,
    )
