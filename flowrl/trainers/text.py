"""GRPO-style RL for Hugging Face causal LMs on the shared loop: the text modality.

An epoch: m prompts x k completions, each sampled from its own seeded stream (`flowrl.llm`) -> rewards from
callables on the decoded completions -> advantages from the `advantage` section (group-relative by default) ->
behaviour (and reference) log-probs in training-sized chunks (so the ratio is exactly 1 at the old weights) ->
`batch.inner_epochs` x mini-batches, each micro-batch one `compute_policy_loss` call on the masked `[b, T]` token
log-probs with any registered objective (the text literature's: `flowrl list objectives`). Token entropies are
computed only for objectives that use them (ASPO, SSPO, ESPO, `top_entropy_quantile`), sentence ids for segment
objectives; a stateful objective's controller (R2VPO's lambda, Clip-Cov's draw counter) is checkpointed with the
run. Objectives that read batch statistics see the whole mini-batch (`flowrl.trainers.scheduler`).

`model.name: arith` is the toy arithmetic LM built offline by `flowrl.llm.build` (a few seconds, cached), with the
`arith/train` and `arith/test` prompt sets; any local folder holding a causal LM and its tokenizer works too.
"""

from __future__ import annotations

import dataclasses

import torch

from flowrl.core import get_objective, kl_estimate
from flowrl.core.terms import Terms
from flowrl.llm.config import TextConfig
from flowrl.llm.modality import TextModality
from flowrl.trainers.algorithm import Algorithm
from flowrl.trainers.registry import register


@register("text", description="GRPO-style RL of Hugging Face causal LMs with any objective of the core")
class TextAlgorithm(Algorithm):
    """See the module docstring and `TextConfig`."""

    config_class = TextConfig
    modality_class = TextModality
    shard_refusal = "generation stops when a process's own completions end, so the processes' forward calls differ"

    def __init__(self, config, modality, engine):
        super().__init__(config, modality, engine)
        spec = get_objective(self.objective)
        self.needs_entropy = "entropy" in spec.inputs or "top_entropy_quantile" in self.objective_hparams
        self.needs_segments = "segment_ids" in spec.inputs
        if self.agg == "seq_mean_token_sum_norm" and "norm_len" not in self.objective_hparams:
            # Dr.GRPO's constant L is the completion budget, not the batch's padded width (which varies)
            self.objective_hparams["norm_len"] = float(config.generation.max_new_tokens)
        self.objective_state = spec.init_state() if spec.init_state is not None else None
        if self.objective_state is not None:
            self.objective_hparams["state"] = self.objective_state  # updated in place by each loss call

    def model(self):
        """The trained model itself (the prepared module unwrapped): what samples and scores without gradient."""
        return self.engine.unwrapped()

    def collector(self):
        self.modality.sampling_model = self.model()
        return self.modality.collector(segments=self.needs_segments)

    def evaluator(self):
        self.modality.sampling_model = self.model()
        return self.modality.evaluator()

    # ------------------------------------------------------------------------------------------
    # the epoch
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self, collected, advantages, trainable, epoch):
        """The behaviour (and reference) log-probs of the completions, in training-sized chunks at the weights that
        sampled them."""
        model = self.engine.model
        model.eval()
        rollout = collected.data
        chunk = self.config.batch.micro_batch_size
        logp, _ = self.modality.log_probs(model, rollout, chunk=chunk)
        ref = self.modality.reference_log_probs(rollout, self.model()) if self.config.kl.beta > 0 else None
        rollout = dataclasses.replace(rollout, log_probs=logp.float(), ref_log_probs=ref)
        return self.update_batch(collected, advantages, trainable, data=rollout), {}

    def num_elements(self, data) -> int:
        return data.completion_ids.shape[1]

    def elements(self, batch, epoch):
        """Every completion token; padding after the end of sequence is masked."""
        k = self.num_elements(batch.data)
        index = torch.arange(k).expand(len(batch.data), k)
        return index, batch.data.completion_mask.gather(1, index)

    def terms(self, batch, index):
        data = batch.data
        logp, entropy = self.modality.log_probs(self.engine.model, data, with_entropy=self.needs_entropy)
        inputs = {}
        if entropy is not None:
            inputs["entropy"] = entropy.gather(1, index)
        if self.needs_segments:
            inputs["segment_ids"] = data.segment_ids.gather(1, index)
        logp = logp.gather(1, index)
        penalty, logs = None, {}
        beta = self.config.kl.coef(self.epoch)
        if beta > 0:
            kl = kl_estimate(self.config.kl.form, logp, data.ref_log_probs.gather(1, index))  # [b, c]
            penalty, logs = beta * kl, {"kl": kl.detach()}
        return Terms(logp=logp, old_logp=data.log_probs.gather(1, index), inputs=inputs, penalty=penalty, logs=logs)

    # ------------------------------------------------------------------------------------------
    # checkpoints
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
