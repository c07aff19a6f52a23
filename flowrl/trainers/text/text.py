"""GRPO-style RL for Hugging Face causal LMs on the shared loop: the text modality.

An epoch: m prompts x k completions, each sampled from its own seeded stream (`flowrl.llm`) -> rewards from
callables on the decoded completions -> advantages from the `advantage` section (group-relative by default) ->
behaviour (and reference) log-probs in training-sized chunks (so the ratio is exactly 1 at the old weights) ->
`batch.inner_epochs` x mini-batches, each micro-batch one `compute_policy_loss` call on the masked `[b, T]` token
log-probs with any registered objective (the text literature's: `flowrl list objectives`). Token entropies are
computed only for objectives that use them (ASPO, SSPO, ESPO, `top_entropy_quantile`), sentence ids for segment
objectives; a stateful objective's controller (R2VPO's lambda, Clip-Cov's draw counter) is checkpointed with the
run. Objectives that read batch statistics see the whole mini-batch (`flowrl.run.scheduler`).

TROLL (`objective.name: troll`, `flowrl.core.text.troll`) reads each token's next-token support: `prepare` stores the
sampled token and the behaviour policy's `top_k` most likely others with their log-probs (`[B, T, top_k + 1]`, only
for objectives whose inputs name `topk_logp`: the default path's cost is unchanged) and every training forward
gathers the current log-probs at the same ids. `sync_reference: true` is Humanline's syncing (arXiv:2509.24207,
HALOs `humanline=true`): the ratio's anchor is the policy one optimizer step earlier, kept as two lagged copies of
the trained weights (`theta_{t-1}`, the anchor, and `theta_t`, the next one) that are checkpointed with the run.

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
from flowrl.run.algorithm import Algorithm
from flowrl.run.registry import register
from flowrl.run.state import EMA


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
        self.group_inputs = tuple(k for k in ("group", "token_ids", "ref_logp") if k in spec.required)
        """What a group objective takes per element (`flowrl.core.text.group`): group ids (mini-batches then
        hold whole groups), token ids, the reference's log-probs (a reference model is then kept)."""
        if "group" in self.group_inputs:
            self.updates_groups = True
        self.needs_support = "topk_logp" in spec.inputs
        """TROLL: store the behaviour policy's top-k support at `prepare`, gather it again in each forward."""
        self.support_k = int(self.objective_hparams.get("top_k", spec.hparams.get("top_k", 0)))
        if self.needs_support and (config.batch.backward == "per_step" or config.optim.step_grad_norms_every):
            raise ValueError(
                f"objective {self.objective!r} reads [b, T, V] supports: use batch.backward: whole and "
                "optim.step_grad_norms_every: 0"
            )
        if self.needs_support and config.sync_reference:
            raise ValueError(
                f"objective {self.objective!r} anchors at the behaviour policy's stored supports: "
                "sync_reference must be false"
            )
        self.anchor = self.pending = None
        self.sync_due = False
        """Whether an optimizer step was taken since the anchor was last synced (`sync_reference`)."""
        if self.agg == "seq_mean_token_sum_norm" and "norm_len" not in self.objective_hparams:
            # Dr.GRPO's constant L is the completion budget, not the batch's padded width (which varies)
            self.objective_hparams["norm_len"] = float(config.generation.max_new_tokens)
        self.objective_state = spec.init_state() if spec.init_state is not None else None
        if self.objective_state is not None:
            self.objective_hparams["state"] = self.objective_state  # updated in place by each loss call

    def build(self):
        super().build()
        if self.config.sync_reference:
            params = [p for p in self.trained_module().parameters() if p.requires_grad]
            self.anchor = EMA(params, 0.0, prefix="sync_anchor")  # theta_{t-1}: the ratio's anchor
            self.pending = EMA(params, 0.0, prefix="sync_pending")  # theta_t: the anchor of the next step

    def needs_reference(self) -> bool:
        return super().needs_reference() or "ref_logp" in self.group_inputs

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
        if self.needs_support:  # the sampled token and the behaviour policy's top-k others, with their log-probs
            logp, _, ids, support = self.modality.support_log_probs(model, rollout, top_k=self.support_k, chunk=chunk)
            rollout = dataclasses.replace(rollout, support_ids=ids, support_log_probs=support.float())
        else:
            logp, _ = self.modality.log_probs(model, rollout, chunk=chunk)
        ref = self.modality.reference_log_probs(rollout, self.model()) if self.needs_reference() else None
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
        old_logp = data.log_probs if self.anchor is None else self.anchor_log_probs(data)  # before the grad forward
        inputs = {}
        if self.needs_support:
            logp, entropy, _, support = self.modality.support_log_probs(
                self.engine.model, data, with_entropy=self.needs_entropy
            )
            columns = index.unsqueeze(-1).expand(-1, -1, support.shape[-1])  # [b, c, V]
            inputs["topk_logp"] = support.gather(1, columns)
            inputs["old_topk_logp"] = data.support_log_probs.gather(1, columns.to(data.support_log_probs.device))
        else:
            logp, entropy = self.modality.log_probs(self.engine.model, data, with_entropy=self.needs_entropy)
        if entropy is not None:
            inputs["entropy"] = entropy.gather(1, index)
        if self.needs_segments:
            inputs["segment_ids"] = data.segment_ids.gather(1, index)
        if "group" in self.group_inputs:
            inputs["group"] = batch.group_ids.to(index.device)[:, None].expand_as(index)
        if "token_ids" in self.group_inputs:
            inputs["token_ids"] = data.completion_ids.gather(1, index)
        if "ref_logp" in self.group_inputs:
            inputs["ref_logp"] = data.ref_log_probs.gather(1, index)
        logp = logp.gather(1, index)
        penalty, logs = None, {}
        beta = self.config.kl.coef(self.epoch)
        if beta > 0:
            kl = kl_estimate(self.config.kl.form, logp, data.ref_log_probs.gather(1, index))  # [b, c]
            penalty, logs = beta * kl, {"kl": kl.detach()}
        return Terms(logp=logp, old_logp=old_logp.gather(1, index), inputs=inputs, penalty=penalty, logs=logs)

    # ------------------------------------------------------------------------------------------
    # Humanline's anchor (`sync_reference`)
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def anchor_log_probs(self, data) -> torch.Tensor:
        """`[b, T]` log-probs under the anchor `theta_{t-1}`. The first loss of each optimizer step syncs: the
        anchor takes the weights the previous step started from and `pending` the current ones, as HALOs syncs its
        reference after the backward and before the step (so the first step's ratio is exactly 1)."""
        if self.sync_due:
            for anchor, pending in zip(self.anchor.shadow, self.pending.shadow):
                anchor.copy_(pending)
            self.pending.update(0.0)  # pending <- theta_t
            self.sync_due = False
        with self.anchor.swapped():
            return self.modality.log_probs(self.engine.model, data)[0].float()

    def after_step(self) -> None:
        super().after_step()
        if self.anchor is not None:
            self.sync_due = True

    def lagged_copies(self):
        return [self.anchor, self.pending] if self.anchor is not None else []

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------

    def state_dict(self):
        state, tensors = super().state_dict()
        if self.objective_state is not None:
            state["objective_state"] = dict(self.objective_state)
        if self.anchor is not None:
            state["sync_due"] = self.sync_due
        return state, tensors

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state, tensors)
        self.sync_due = bool(state.get("sync_due", False))
        if self.objective_state is not None and "objective_state" in state:
            self.objective_state.clear()
            self.objective_state.update(state["objective_state"])  # the dict the loss calls hold
