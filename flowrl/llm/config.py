"""The text modality's config: the causal LM, generation, held-out evaluation, and the text trainer's sections."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from flowrl.objective_sections import HasESSScaling
from flowrl.sections import (
    BatchConfig,
    EvalConfig,
    HasGroupFilter,
    HasKL,
    HasObjective,
    KLConfig,
    OptimConfig,
    PromptConfig,
    PromptedConfig,
    RewardConfig,
    RunConfig,
)


@dataclasses.dataclass
class TextModelConfig:
    """The causal LM."""

    name: str = "arith"
    """`arith` (the toy arithmetic LM, built and cached offline) or a local folder with a `transformers` causal
    LM and its tokenizer."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Weights' dtype (log-prob math is fp32 regardless)."""
    lora_rank: int = 0
    """LoRA rank (0: train every weight)."""
    lora_alpha: float | None = None
    """LoRA alpha (None: the rank)."""
    lora_targets: list[str] | None = None
    """Module names LoRA adapts (None: peft's default for the architecture)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more time)."""


@dataclasses.dataclass
class GenerationConfig:
    """Sampling the completions."""

    max_new_tokens: int = 8
    """Completion length limit (tokens)."""
    temperature: float = 1.0
    """Sampling temperature; the log-probs are those of the tempered distribution (the behaviour policy)."""
    top_k: int = 0
    """Sample from the k most likely tokens (0: all). Anything but 0 makes the behaviour policy differ from the
    trained density; keep 0 for on-policy ratios."""

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.temperature <= 0 or self.top_k < 0:
            raise ValueError(
                "generation.max_new_tokens must be >= 1, generation.temperature > 0, generation.top_k >= 0"
            )


@dataclasses.dataclass
class TextEvalConfig(EvalConfig):
    """Held-out evaluation on the test prompts."""

    greedy: bool = True
    """Greedy completions (one per prompt); False samples `samples_per_prompt` at the training temperature."""
    samples_per_prompt: int = 4
    """Completions per test prompt when sampling (`greedy: false`)."""
    max_prompts: int | None = 256
    """Test prompts used (None: all)."""
    metrics: list[str] = dataclasses.field(default_factory=list)
    """Extra per-sample metrics that are never optimised (gold metrics), by reward name."""


def _text_prompts() -> PromptConfig:
    return PromptConfig(train="arith/train", test="arith/test", prompts_per_epoch=32, group_size=8)


def _text_rewards() -> list[RewardConfig]:
    return [RewardConfig(name="arith_exact")]


@dataclasses.dataclass
class TextConfig(HasObjective, HasKL, HasGroupFilter, HasESSScaling, PromptedConfig):
    """The text trainer: see `flowrl.trainers.text.text`."""

    kl_forms: ClassVar[tuple[str, ...]] = ("k1", "k2", "k3")
    renamed: ClassVar[dict[str, str]] = {
        "generation.minibatch_size": "batch.mini_batch_size (completions per optimizer step, over every process)",
        "generation.batch_size": "batch.micro_batch_size (rows per generate call and per forward, on each process)",
        "generation.logprob_chunk": "batch.micro_batch_size (rows per forward on each process)",
    }
    absent: ClassVar[dict[str, str]] = {
        "sampling": "the text trainer samples completions (`generation`), not images",
        "steps": "the text trainer trains every completion token",
        "env": "the text trainer samples prompts, not environments",
    }

    model: TextModelConfig = dataclasses.field(default_factory=TextModelConfig)
    """The causal LM."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    """Sampling."""
    prompts: PromptConfig = dataclasses.field(default_factory=_text_prompts)
    """Prompt sets (`arith/train`, `arith/test`, or `.txt` / `.jsonl` files whose metadata the rewards read) and
    m prompts x k completions per epoch."""
    rewards: list[RewardConfig] = dataclasses.field(default_factory=_text_rewards)
    """Reward callables `reward(completions, prompts, **metadata) -> [B]` (registered names or `module:attr`)."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(form="k3"))
    """KL to the initial model, per token (`k1`, `k2`, `k3`; beta 0: off and no reference model is kept)."""
    eval: TextEvalConfig = dataclasses.field(default_factory=TextEvalConfig)
    """Held-out evaluation."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-4, weight_decay=0.0))
    """The optimizer."""
    batch: BatchConfig = dataclasses.field(
        default_factory=lambda: BatchConfig(mini_batch_size=64, micro_batch_size=256)
    )
    """64 completions per optimizer step (over every process); at most 256 rows per generate call and per forward
    on each process (a mini-batch's share trains in one call)."""
    run: RunConfig = dataclasses.field(default_factory=lambda: RunConfig(epochs=30, save_every=10, samples_every=10))
    """Run folder, epochs, seeds, logging, checkpoints (`samples_every`: completions written to `samples/`)."""
    sync_reference: bool = False
    """Humanline's syncing (arXiv:2509.24207; HALOs `humanline=true`): the ratio's anchor `old_logp` is the policy
    as it was one optimizer step earlier, synced every step (the first step's anchor is the initial weights), not
    the behaviour policy that sampled the epoch. Costs one forward without gradient per micro-batch and two copies
    of the trained weights (checkpointed). Use with `objective.name: humanline` (`configs/llm/arith_humanline.yaml`).
    """
