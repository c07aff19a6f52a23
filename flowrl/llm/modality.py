"""The text modality of a run: the causal LM and its tokenizer, the rewards and prompt sets, and the collector and
evaluator it builds; token log-probs of a rollout under any of its models."""

from __future__ import annotations

import torch

from flowrl import rewards as reward_registry
from flowrl.llm.collect import TextCollector, TextEvaluator
from flowrl.llm.config import TextConfig
from flowrl.llm.logprobs import token_log_probs, token_support_log_probs
from flowrl.llm.policy import build_text_policy, load_text_prompts
from flowrl.llm.rollout import TokenRollout
from flowrl.rewards import Rewards
from flowrl.rewards.scoring import reward_summary
from flowrl.runtime import RunContext


class TextModality:
    """See the module docstring.

    Args:
        config (`TextConfig`): the run's config.
        context (`RunContext`): processes, device, the log.
        policy (`TextPolicy`, *optional*): use this policy instead of loading `config.model`.
        reward_fns, eval_fns (`dict`, *optional*): the training rewards and extra metrics by name.
        memory: unused.
        scoring (`bool`): build the rewards and extra metrics (False: a policy that only samples).
    """

    budget_key = "reward_evals"

    def __init__(
        self,
        config: TextConfig,
        context: RunContext,
        *,
        policy=None,
        reward_fns: dict | None = None,
        eval_fns: dict | None = None,
        memory=None,
        scoring: bool = True,
    ):
        self.config, self.context = config, context
        # before the rewards and the model: a bad prompt set fails first
        self.train_prompts = load_text_prompts(config.prompts.train)
        if config.prompts.val:
            raise ValueError(
                "prompts.val (a validation set for eval.best_metric) is for image trainers; text trainers "
                "evaluate prompts.test only"
            )
        test = load_text_prompts(config.prompts.test)
        self.test_prompts = test[: config.eval.max_prompts] if config.eval.max_prompts else test
        if not self.train_prompts or not self.test_prompts:
            raise ValueError(f"empty prompt set: {config.prompts.train!r} or {config.prompts.test!r}")
        self.rewards, self.eval_fns = None, {}
        if scoring:
            if reward_fns is None:
                reward_fns = {s.name: reward_registry.get(s.name, **s.kwargs) for s in config.rewards}
            self.eval_fns = {n: reward_registry.get(n) for n in config.eval.metrics} if eval_fns is None else eval_fns
            weights = {spec.name: spec.weight for spec in config.rewards}
            self.rewards = Rewards(reward_fns, weights, context.processes, config.run.max_bad_reward_frac)
        if policy is None:
            policy = build_text_policy(config.model, seed=config.run.seed, reference=config.kl.beta > 0)
            policy.model.to(context.device)
            if policy.reference is not None:
                policy.reference.to(context.device)
        self.policy = policy
        self.sampling_model = policy.model
        """The module that samples: the policy's model (a trainer sets the prepared one, unwrapped)."""

    def ensure_reference(self, offload: bool = False) -> None:
        """The reference of a KL: the frozen copy `build_text_policy` keeps, or (LoRA) the adapter disabled."""
        if self.policy.reference is None and not self.policy.has_lora:
            import copy

            self.policy.reference = copy.deepcopy(self.policy.model).eval().requires_grad_(False)

    # ------------------------------------------------------------------------------------------
    # the parts
    # ------------------------------------------------------------------------------------------

    def collector(self, *, segments: bool = False) -> TextCollector:
        c = self.config
        return TextCollector(
            policy=self.policy,
            model=self.sampling_model,
            generation=c.generation,
            rewards=self.rewards,
            processes=self.context.processes,
            train_prompts=self.train_prompts,
            prompts_per_epoch=c.prompts.prompts_per_epoch,
            group_size=c.prompts.group_size,
            batch_size=c.batch.micro_batch_size,
            seed=c.run.seed,
            segments=segments,
        )

    def evaluator(self) -> TextEvaluator:
        ev = self.config.eval
        return TextEvaluator(
            policy=self.policy,
            model=self.sampling_model,
            generation=self.config.generation,
            rewards=self.rewards,
            extra=self.eval_fns,
            prompts=self.test_prompts,
            greedy=ev.greedy,
            samples=ev.samples_per_prompt,
            seed=ev.seed,
            batch_size=self.config.batch.micro_batch_size,
        )

    def log_probs(self, model, rollout: TokenRollout, *, with_entropy: bool = False, chunk: int | None = None):
        """`(log_probs [B, T], entropy or None)` of the rollout's completion tokens under `model`."""
        return token_log_probs(
            model,
            rollout.input_ids,
            rollout.attention_mask,
            rollout.prompt_ids.shape[1],
            chunk_size=chunk,
            temperature=self.config.generation.temperature,
            with_entropy=with_entropy,
        )

    def support_log_probs(
        self, model, rollout: TokenRollout, *, top_k: int = 0, with_entropy: bool = False, chunk: int | None = None
    ):
        """`(log_probs [B, T], entropy or None, support ids [B, T, V], support log-probs [B, T, V])` under `model`:
        the rollout's stored support (`rollout.support_ids`) when it has one, else the sampled token and `model`'s
        `top_k` most likely others (TROLL, `flowrl.llm.logprobs.token_support_log_probs`)."""
        return token_support_log_probs(
            model,
            rollout.input_ids,
            rollout.attention_mask,
            rollout.prompt_ids.shape[1],
            top_k=top_k,
            ids=rollout.support_ids,
            chunk_size=chunk,
            temperature=self.config.generation.temperature,
            with_entropy=with_entropy,
        )

    def reference_log_probs(self, rollout: TokenRollout, model) -> torch.Tensor:
        """The reference's token log-probs (the frozen copy, or `model` with its LoRA adapter disabled)."""
        chunk = self.config.batch.micro_batch_size
        if self.policy.reference is not None:
            return self.log_probs(self.policy.reference, rollout, chunk=chunk)[0].float()
        with model.disable_adapter():  # LoRA: the base weights are the reference
            return self.log_probs(model, rollout, chunk=chunk)[0].float()

    # ------------------------------------------------------------------------------------------
    # an epoch's record and samples
    # ------------------------------------------------------------------------------------------

    def check(self, collected) -> tuple[torch.Tensor, dict]:
        valid, bad = self.rewards.check(collected.rewards)
        return valid, {**reward_summary(collected.rewards, collected.total, valid), **bad}

    def log_samples(self, collected, folder, epoch: int, trackers=()) -> None:
        """The epoch's first completions (this process's) with their rewards (`samples/epoch_N.txt`)."""
        rollout = collected.data
        out = folder / "samples"
        out.mkdir(parents=True, exist_ok=True)
        prompts = self.policy.tokenizer.batch_decode(rollout.prompt_ids, skip_special_tokens=True)
        rewards = {k: v[collected.rows] for k, v in collected.rewards.items()}
        lines = [
            f"{p!r} -> {c!r}  " + " ".join(f"{k}={float(v[i]):.3g}" for k, v in rewards.items())
            for i, (p, c) in enumerate(zip(prompts, rollout.completions))
        ][:64]
        (out / f"epoch_{epoch:04d}.txt").write_text("\n".join(lines) + "\n")

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Nothing to restore: an epoch depends only on the weights and seeds."""
