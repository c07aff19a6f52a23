"""GRPO-style RL for Hugging Face causal LMs on the shared loop: the text modality.

An epoch: m prompts x k completions sampled with `generate` -> behaviour log-probs computed in training-sized
chunks (so the ratio is exactly 1 at the old weights) -> rewards from callables on the decoded completions ->
advantages from the `advantage` section (group-relative by default) -> `inner_epochs` x minibatches, each one
`compute_policy_loss` call on the masked `[b, T]` token log-probs with any registered objective (the text
literature's: `flowrl list objectives`). Token entropies are computed only for objectives that use them
(ASPO, SSPO, ESPO, `top_entropy_quantile`), sentence ids for segment objectives; a stateful objective's
controller (R2VPO's lambda, Clip-Cov's draw counter) is checkpointed with the run. LoRA through peft, accelerate,
checkpoints and exact resume are the shared loop's.

`model.name: arith` is the toy arithmetic LM built offline by `flowrl.llm.build` (a few seconds, cached), with the
`arith/train` and `arith/test` prompt sets; any local folder holding a causal LM and its tokenizer works too.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import ClassVar

import torch

from flowrl import prompts as prompt_sets
from flowrl.config import EvalConfig, KLConfig, OptimConfig, PromptConfig, RewardConfig, RunConfig, TrainerConfig
from flowrl.core import get_objective, kl_estimate
from flowrl.llm.collect import TextCollector, TextEvaluator
from flowrl.llm.logprobs import token_log_probs
from flowrl.llm.rollout import TokenRollout, completion_mask, sentence_ids
from flowrl.trainers.base import Trainer
from flowrl.trainers.registry import TRAINERS
from flowrl.trainers.update import Terms


@dataclasses.dataclass
class TextModelConfig:
    """The causal LM."""

    name: str = "arith"
    """`arith` (the toy arithmetic LM, built and cached offline) or a local folder with a `transformers` causal
    LM and its tokenizer."""
    dtype: str = "fp32"
    """Weights' dtype: `fp32`, `bf16`, `fp16` (log-prob math is fp32 regardless)."""
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
    """Sampling the completions and computing their log-probs."""

    max_new_tokens: int = 8
    """Completion length limit (tokens)."""
    temperature: float = 1.0
    """Sampling temperature; the log-probs are those of the tempered distribution (the behaviour policy)."""
    top_k: int = 0
    """Sample from the k most likely tokens (0: all). Anything but 0 makes the behaviour policy differ from the
    trained density; keep 0 for on-policy ratios."""
    batch_size: int = 256
    """Rows per `generate` call."""
    minibatch_size: int = 64
    """Rows per training minibatch (one optimizer step each unless `optim.gradient_accumulation`)."""
    logprob_chunk: int = 128
    """Rows per forward call when computing log-probs without gradient (memory bound)."""


def _text_prompts() -> PromptConfig:
    return PromptConfig(train="arith/train", test="arith/test", prompts_per_epoch=32, group_size=8)


def _text_rewards() -> list[RewardConfig]:
    return [RewardConfig(name="arith_exact")]


def _text_optim() -> OptimConfig:
    return OptimConfig(lr=1e-4, weight_decay=0.0, max_grad_norm=1.0)


def _text_run() -> RunConfig:
    return RunConfig(epochs=30, save_every=10, images_every=10)


@dataclasses.dataclass
class TextEvalConfig(EvalConfig):
    """Held-out evaluation on the test prompts."""

    every: int = 5
    """Evaluate every this many epochs (and always before the first and after the last)."""
    greedy: bool = True
    """Greedy completions (one per prompt); False samples `samples_per_prompt` at the training temperature."""
    max_prompts: int | None = 256
    """Test prompts used (None: all)."""


@dataclasses.dataclass
class TextConfig(TrainerConfig):
    """The text trainer: see the module docstring."""

    unused: ClassVar[tuple[str, ...]] = ("sampling", "steps")
    kl_forms: ClassVar[tuple[str, ...]] = ("k1", "k2", "k3")

    trainer: str = "text"
    model: TextModelConfig = dataclasses.field(default_factory=TextModelConfig)
    """The causal LM."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    """Sampling and log-prob batching."""
    prompts: PromptConfig = dataclasses.field(default_factory=_text_prompts)
    """Prompt sets (`arith/train`, `arith/test`, or `.txt` / `.jsonl` files whose metadata the rewards read) and
    m prompts x k completions per epoch."""
    rewards: list[RewardConfig] = dataclasses.field(default_factory=_text_rewards)
    """Reward callables `reward(completions, prompts, **metadata) -> [B]` (registered names or `module:attr`)."""
    kl: KLConfig = dataclasses.field(default_factory=lambda: KLConfig(form="k3"))
    """KL to the initial model, per token (`k1`, `k2`, `k3`; beta 0: off and no reference model is kept)."""
    eval: TextEvalConfig = dataclasses.field(default_factory=TextEvalConfig)
    """Held-out evaluation."""
    optim: OptimConfig = dataclasses.field(default_factory=_text_optim)
    """The optimizer."""
    run: RunConfig = dataclasses.field(default_factory=_text_run)
    """Run folder, epochs, seeds, logging, checkpoints (`images_every`: completions written to `samples/`)."""

    def checks(self) -> list[tuple[bool, str]]:
        g = self.generation
        return [
            *super().checks(),
            (g.max_new_tokens >= 1, "generation.max_new_tokens must be >= 1"),
            (g.temperature > 0, "generation.temperature must be > 0"),
            (min(g.batch_size, g.minibatch_size, g.logprob_chunk) >= 1,
             "generation.batch_size, minibatch_size and logprob_chunk must be >= 1"),
            (self.model.dtype in ("fp32", "bf16", "fp16"), "model.dtype must be fp32, bf16 or fp16"),
        ]  # fmt: skip


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


class TextPolicy:
    """The causal LM, its tokenizer, and the frozen reference for a KL penalty (None without one)."""

    def __init__(self, model, tokenizer, reference=None):
        self.model, self.tokenizer, self.reference = model, tokenizer, reference


@TRAINERS.register("text", description="GRPO-style RL of Hugging Face causal LMs with any objective of the core")
class TextTrainer(Trainer):
    """See the module docstring and `TextConfig`."""

    config_class = TextConfig
    shard_refusal = "generation stops when a process's own completions end, so the processes' forward calls differ"

    def __init__(self, config, **kwargs):
        # before the loop builds rewards and models: a bad prompt set fails first
        self.train_prompts = load_text_prompts(config.prompts.train)
        test = load_text_prompts(config.prompts.test)
        self.test_prompts = test[: config.eval.max_prompts] if config.eval.max_prompts else test
        super().__init__(config, **kwargs)

    # ------------------------------------------------------------------------------------------
    # the modality's parts
    # ------------------------------------------------------------------------------------------

    def check_inputs(self) -> None:
        if not self.train_prompts or not self.test_prompts:
            raise ValueError(f"empty prompt set: {self.config.prompts.train!r} or {self.config.prompts.test!r}")

    def build_policy(self) -> TextPolicy:
        m = self.config.model
        torch.manual_seed(self.config.run.seed)
        model, tokenizer = load_causal_lm(m.name, m.dtype)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        reference = None
        if self.config.kl.beta > 0 and not m.lora_rank:
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        if m.lora_rank:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha or m.lora_rank, target_modules=m.lora_targets,
                              lora_dropout=0.0)  # fmt: skip
            model = get_peft_model(model, lora)
        if m.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        return TextPolicy(model, tokenizer, reference)

    def setup(self) -> None:
        spec = get_objective(self.objective)
        self.needs_entropy = "entropy" in spec.inputs or "top_entropy_quantile" in self.objective_hparams
        self.needs_segments = "segment_ids" in spec.inputs
        if self.agg == "seq_mean_token_sum_norm" and "norm_len" not in self.objective_hparams:
            # Dr.GRPO's constant L is the completion budget, not the batch's padded width (which varies)
            self.objective_hparams["norm_len"] = float(self.config.generation.max_new_tokens)
        self.objective_state = spec.init_state() if spec.init_state is not None else None
        if self.objective_state is not None:
            self.objective_hparams["state"] = self.objective_state  # updated in place by each loss call

    def build_collector(self) -> TextCollector:
        cfg = self.config
        return TextCollector(generate=self.generate, behaviour=self.behaviour, rewards=self.rewards,
                             processes=self.processes, train_prompts=self.train_prompts,
                             prompts_per_epoch=cfg.prompts.prompts_per_epoch, group_size=cfg.prompts.group_size,
                             batch_size=cfg.generation.batch_size, seed=cfg.run.seed)  # fmt: skip

    def build_evaluator(self) -> TextEvaluator:
        ev = self.config.eval
        extra = {name: self.build_rewards([RewardConfig(name=name)])[name] for name in ev.metrics}
        return TextEvaluator(complete=self.complete, rewards=self.rewards, extra=extra, prompts=self.test_prompts,
                             greedy=ev.greedy, samples=ev.samples_per_prompt, seed=ev.seed,
                             batch_size=self.config.generation.batch_size)  # fmt: skip

    @property
    def minibatch_size(self) -> int:
        return self.config.generation.minibatch_size

    # ------------------------------------------------------------------------------------------
    # sampling and log-probs
    # ------------------------------------------------------------------------------------------

    def _generate_ids(self, texts: list[str], generator: torch.Generator, greedy: bool):
        tok, g = self.policy.tokenizer, self.config.generation
        batch = tok(texts, padding=True, return_tensors="pt").to(self.accelerator.device)
        seed = int(torch.randint(2**62, (1,), generator=generator))
        model = self.accelerator.unwrap_model(self.model)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # generate draws from the global generator: give it the epoch's stream
            out = model.generate(**batch, do_sample=not greedy, temperature=None if greedy else g.temperature,
                                 top_k=g.top_k if g.top_k and not greedy else None, top_p=None,
                                 max_new_tokens=g.max_new_tokens, pad_token_id=tok.pad_token_id)  # fmt: skip
        prompt_len = batch["input_ids"].shape[1]
        return batch, out[:, prompt_len:]

    @torch.no_grad()
    def generate(self, texts: list[str], generator: torch.Generator) -> TokenRollout:
        """Sampled completions of `texts` as a rollout without log-probs."""
        tok = self.policy.tokenizer
        self.model.eval()
        batch, completion = self._generate_ids(texts, generator, greedy=False)
        mask = completion_mask(completion, tok.eos_token_id)
        completion = torch.where(mask, completion, tok.pad_token_id)
        decoded = tok.batch_decode(completion, skip_special_tokens=True)
        segments = torch.zeros_like(completion)
        if self.needs_segments:
            pieces = [[tok.decode([t]) for t in row[m].tolist()] for row, m in zip(completion, mask)]
            segments = sentence_ids(pieces, completion.shape[1])
        return TokenRollout(prompt_ids=batch["input_ids"], prompt_mask=batch["attention_mask"].bool(),
                            completion_ids=completion, completion_mask=mask, completions=decoded,
                            segment_ids=segments)  # fmt: skip

    @torch.no_grad()
    def complete(self, texts: list[str], generator: torch.Generator, greedy: bool) -> tuple[list[str], torch.Tensor]:
        """Evaluation completions of `texts` and their lengths in tokens."""
        tok = self.policy.tokenizer
        _, completion = self._generate_ids(texts, generator, greedy)
        mask = completion_mask(completion, tok.eos_token_id)
        completion = torch.where(mask, completion, tok.pad_token_id)
        return tok.batch_decode(completion, skip_special_tokens=True), mask.sum(-1)

    def log_probs(self, model, rollout: TokenRollout, *, with_entropy: bool = False, chunk: int | None = None):
        return token_log_probs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_ids.shape[1],
                               chunk_size=chunk, temperature=self.config.generation.temperature,
                               with_entropy=with_entropy)  # fmt: skip

    @torch.no_grad()
    def behaviour(self, rollout: TokenRollout) -> TokenRollout:
        """The behaviour (and reference) log-probs of a rollout, in training-sized chunks at the current weights."""
        self.model.eval()
        logp, _ = self.log_probs(self.model, rollout, chunk=self.config.generation.minibatch_size)
        ref = None
        if self.config.kl.beta > 0:
            ref = self.reference_log_probs(rollout)
        return dataclasses.replace(rollout, log_probs=logp.float(), ref_log_probs=ref)

    def reference_log_probs(self, rollout: TokenRollout) -> torch.Tensor:
        chunk = self.config.generation.logprob_chunk
        if self.policy.reference is not None:
            return self.log_probs(self.policy.reference, rollout, chunk=chunk)[0].float()
        model = self.accelerator.unwrap_model(self.model)
        with model.disable_adapter():  # LoRA: the base weights are the reference
            return self.log_probs(model, rollout, chunk=chunk)[0].float()

    # ------------------------------------------------------------------------------------------
    # elements
    # ------------------------------------------------------------------------------------------

    def num_elements(self, rollout: TokenRollout) -> int:
        return rollout.completion_ids.shape[1]

    def train_elements(self, rollout: TokenRollout, epoch: int) -> torch.Tensor:
        k = self.num_elements(rollout)
        return torch.arange(k).expand(len(rollout), k)

    def element_valid(self, batch: TokenRollout, index: torch.Tensor) -> torch.Tensor:
        return batch.completion_mask.gather(1, index)

    def score(self, batch: TokenRollout, index: torch.Tensor) -> Terms:
        logp, entropy = self.log_probs(self.model, batch, with_entropy=self.needs_entropy)
        inputs = {}
        if entropy is not None:
            inputs["entropy"] = entropy.gather(1, index)
        if self.needs_segments:
            inputs["segment_ids"] = batch.segment_ids.gather(1, index)
        logp = logp.gather(1, index)
        penalty, logs = None, {}
        beta = self.config.kl.coef(self.epoch)
        if beta > 0:
            kl = kl_estimate(self.config.kl.form, logp, batch.ref_log_probs.gather(1, index))  # [b, c]
            penalty, logs = beta * kl, {"kl": kl.detach()}
        return Terms(logp=logp, old_logp=batch.log_probs.gather(1, index), inputs=inputs, penalty=penalty, logs=logs)

    # ------------------------------------------------------------------------------------------
    # checkpoints and samples
    # ------------------------------------------------------------------------------------------

    def state_dict(self):
        state, tensors = super().state_dict()
        if self.objective_state is not None:
            state["objective_state"] = dict(self.objective_state)
        return state, tensors

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state, tensors)
        if self.objective_state is not None and "objective_state" in state:
            self.objective_state.clear()
            self.objective_state.update(state["objective_state"])  # the dict the loss calls hold

    def log_samples(self) -> None:
        """The latest epoch's first completions with their rewards (`samples/epoch_N.txt`)."""
        if not self.is_main or self.last_epoch is None:
            return
        rollout, rewards = self.last_epoch
        folder = self.output_dir / "samples"
        folder.mkdir(exist_ok=True)
        prompts = self.collector_prompts(rollout)
        lines = [f"{p!r} -> {c!r}  " + " ".join(f"{k}={float(v[i]):.3g}" for k, v in rewards.items())
                 for i, (p, c) in enumerate(zip(prompts, rollout.completions))][:64]  # fmt: skip
        (folder / f"epoch_{self.epoch:04d}.txt").write_text("\n".join(lines) + "\n")

    def collector_prompts(self, rollout: TokenRollout) -> list[str]:
        tok = self.policy.tokenizer
        return tok.batch_decode(rollout.prompt_ids, skip_special_tokens=True)


def load_causal_lm(name: str, dtype: str = "fp32"):
    """`(model, tokenizer)`: the toy `arith` LM (built and cached on first use) or a local causal-LM folder."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if name == "arith":
        from flowrl.llm.build import build, load

        model, tokenizer = load(build())
        return model.to(torch_dtype), tokenizer
    from pathlib import Path

    if not Path(name).is_dir():
        raise FileNotFoundError(f"model.name {name!r} is neither 'arith' nor a local folder with a causal LM and "
                                "its tokenizer (flowrl does not download models at run time)")  # fmt: skip
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype)
    return model, AutoTokenizer.from_pretrained(name)
