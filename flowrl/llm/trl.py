"""trl interop: any flowrl objective as the policy loss of trl's `GRPOTrainer` (trl >= 1.16, < 2).

    from flowrl.llm.trl import FlowrlGRPOConfig, FlowrlGRPOTrainer

    args = FlowrlGRPOConfig(output_dir="out", objective="gspo", objective_kwargs={"clip_eps_high": 4e-4})
    trainer = FlowrlGRPOTrainer(model, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()

`FlowrlGRPOTrainer` overrides only `GRPOTrainer._compute_loss` (the pattern of trl's own experimental GMPO
trainer): generation, rewards, advantages, reference and behaviour log-probs, vLLM, logging and checkpointing
are trl's. The policy term is `flowrl.core.compute_policy_loss(objective, ...)`; the rest of trl's loss is kept:

- the k3 KL to the reference model (`beta`, `ref_per_token_logps`), times the objective's ratio when
  `use_bias_correction_kl` (the token ratio, or GSPO's sequence ratio for an objective whose log-ratio couples
  the tokens),
- the vLLM importance-sampling correction (`importance_sampling_ratio`, multiplied onto the policy term),
- the off-policy sequence mask (`off_policy_mask_threshold`), the high-entropy token mask
  (`top_entropy_quantile`), the entropy bonus (`entropy_coef`, adaptive or not), the MoE router auxiliary loss,
- trl's normalisers (`reference/algorithms-llm.md` sec. 0.4, 3.2). An objective whose aggregation is
  `token_mean` divides its masked sum by the global token count of one accumulation window,
  `num_items_in_batch / num_processes * current_gradient_accumulation_steps / steps_per_generation` (trl's
  `dapo`, `cispo`, `vespo`), or by the local one times the accumulation steps with
  `token_mean_normalizer="local"` (trl's `bnpo`); every other aggregation is computed on the micro-batch and
  divided by `current_gradient_accumulation_steps` (1 in eval). Sequence means divide by the number of rows B,
  as trl does, not by flowrl's B' (rows with a valid token): a fully masked row (a truncated completion under
  `mask_truncated_completions`) counts as a zero.

So an objective equal to a trl loss type gives trl's loss value and gradients (`trl_loss_as_objective` gives
the mapping; `tests/llm/test_trl.py` checks it against trl's own `_compute_loss`).

Not carried over: trl's own loss fields (`loss_type`, `epsilon`, `epsilon_high`, `delta`,
`importance_sampling_level`, `sapo_temperature_*`, `vespo_*`) are ignored (the objective's hyper-parameters come
from `objective_kwargs`); trl's `clip_ratio/low_min`, `clip_ratio/high_max` and `cispo_clip_ratio` metrics are
replaced by flowrl's (`flowrl/clipfrac`, ratio statistics, ...); a stateful objective's controller state lives on
the trainer (`objective_state`) and is not written to trl's checkpoints; segment objectives get the turns of a
completion as segments (`turn_ids`) unless a subclass adds `inputs["segment_ids"]`; trl's Liger-kernel loss path
is bypassed; trl skips the vLLM importance-sampling multiply for its own `vespo` (which folds the ratio into its
weight), this trainer applies it to every objective.
"""

from __future__ import annotations

from typing import Any


try:
    from trl import GRPOTrainer
except ImportError as err:  # the `trl` extra
    raise ImportError("flowrl.llm.trl needs trl: pip install 'flowrl-toolkit[trl]'") from err

import torch

from flowrl.core.aggregation import aggregation_weights
from flowrl.core.masking import float_mask
from flowrl.core.objectives import get_objective, gspo_log_ratio
from flowrl.core.policy_loss import compute_policy_loss
from flowrl.core.ratios import sequence_log_ratio
from flowrl.llm.trl_config import FlowrlGRPOConfig, trl_loss_as_objective


__all__ = ["FlowrlGRPOConfig", "FlowrlGRPOTrainer", "trl_loss_as_objective", "turn_ids"]


def turn_ids(completion_mask: torch.Tensor, tool_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, T]` turn index of each completion token: a new turn starts at each model token after a tool output.

    trl's `tool_mask` is 1 on the model's tokens and 0 on the tool outputs spliced into the completion; without it
    the completion is one turn (all zeros).
    """
    if tool_mask is None:
        return torch.zeros_like(completion_mask, dtype=torch.long)
    model_token = tool_mask.bool()
    starts = model_token[:, 1:] & ~model_token[:, :-1]  # [B, T-1]: a model token right after a tool token
    return torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1).long().cumsum(-1)


class FlowrlGRPOTrainer(GRPOTrainer):
    """trl's `GRPOTrainer` with a flowrl objective as its policy loss (configured by `FlowrlGRPOConfig`).

    Only `_compute_loss` differs from trl: per-token log-probs and entropies come from trl's
    `_get_per_token_logps_and_entropies`, the behaviour log-probs are `inputs["old_per_token_logps"]` (or the
    detached current ones when trl skips them, on-policy), the mask is `completion_mask * tool_mask`, and
    `flowrl.core.compute_policy_loss(objective, ...)` gives the policy term, reduced with trl's normalisers (see
    the module docstring for what is and is not carried over). flowrl's diagnostics are logged as
    `flowrl/<name>` (`flowrl/clipfrac`, `flowrl/ratio_mean`, ...), and trl's `clip_ratio/{low,high,region}_mean`
    from flowrl's clip fractions.

    Args:
        model, reward_funcs, **kwargs: as `GRPOTrainer`.
        args (`FlowrlGRPOConfig`, *optional*): a plain `GRPOConfig` is rejected (its loss fields would be
            silently ignored); convert it with `FlowrlGRPOConfig(**trl_loss_as_objective(args), ...)`.
    """

    _tag_names = ["trl", "grpo", "flowrl"]

    def __init__(self, model, reward_funcs, args: FlowrlGRPOConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = FlowrlGRPOConfig(f"{model_name.split('/')[-1]}-GRPO")
        if not isinstance(args, FlowrlGRPOConfig):
            raise TypeError(
                f"FlowrlGRPOTrainer needs a FlowrlGRPOConfig, got {type(args).__name__}: "
                "FlowrlGRPOConfig(objective=..., objective_kwargs=...) (see trl_loss_as_objective)"
            )
        super().__init__(model, reward_funcs, args=args, **kwargs)
        self.objective_state: dict | None = None
        """A stateful objective's controller state (created on the first loss; not checkpointed)."""

    def _objective_inputs(self, objective, hparams, inputs, entropies) -> dict[str, Any]:
        """The extra inputs (`entropy`, `segment_ids`, `state`) the objective names (flowrl cores that have them).

        `segment_ids` are `inputs["segment_ids"]` when a subclass provides them, else the turn of each token
        (`turn_ids`): segment objectives (Turn-PPO) see the turns of a tool-calling completion, and a single-turn
        completion is one segment (sentence segments, SSPO's, need a subclass).
        """
        wanted = set(getattr(objective, "inputs", ()))
        if hparams.get("top_entropy_quantile", objective.hparams.get("top_entropy_quantile")) is not None:
            wanted.add("entropy")
        extra: dict[str, Any] = {}
        if "entropy" in wanted:
            extra["entropy"] = entropies
        if "segment_ids" in wanted:
            extra["segment_ids"] = inputs.get("segment_ids")
            if extra["segment_ids"] is None:
                extra["segment_ids"] = turn_ids(inputs["completion_mask"], inputs.get("tool_mask"))
        if "state" in wanted:
            if self.objective_state is None:
                self.objective_state = objective.init_state()
            extra["state"] = self.objective_state
        return extra

    def _aggregation(self, mask, agg, inputs, mode) -> tuple[str, torch.Tensor | float, float]:
        """trl's normaliser as flowrl's aggregation times a scalar: `(core_agg, factor, scale)`.

        The policy loss is `factor * aggregate(l, mask, core_agg)`; `scale` is trl's accumulation factor, what its
        logged `policy_loss` is multiplied back by (1 for the global token mean).
        """
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if agg == "token_mean" and self.args.token_mean_normalizer == "global":
            if "num_items_in_batch" in inputs:
                # num_items_in_batch counts the tokens of the whole generation batch (steps_per_generation
                # micro-batches, every process): rescale it to one accumulation window of one process, as trl does
                per_window = self.accelerator.num_processes
                if mode == "train":
                    per_window *= self.args.steps_per_generation / self.current_gradient_accumulation_steps
                return "sum", inputs["num_items_in_batch"].clamp(min=1.0).reciprocal().mul_(per_window), 1.0
            return "token_mean", 1.0 / accumulation, 1.0
        factor = 1.0 / accumulation
        if agg.startswith("seq_mean"):
            # trl averages over all B rows (a fully masked row counts as 0); flowrl over the B' non-empty ones
            num_valid = (mask.sum(-1) > 0).sum().clamp(min=1)
            factor = num_valid / (mask.shape[0] * accumulation)
        return agg, factor, accumulation

    def _compute_loss(self, model, inputs):
        """trl's `_compute_loss` with the policy term of `flowrl.core.compute_policy_loss(args.objective)`."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)  # only the completion tokens are scored
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        mask = float_mask(mask.bool(), torch.float32)  # [B, T] 0/1 floats (via bool: 1.5x faster than long -> float)

        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            num_images=inputs.get("num_images"),
            pixel_attention_mask=inputs.get("pixel_attention_mask"),
            spatial_shapes=inputs.get("spatial_shapes"),
            num_tiles=inputs.get("num_tiles"),
            image_sizes=inputs.get("image_sizes"),
            token_type_ids=inputs.get("token_type_ids"),
            mm_token_type_ids=inputs.get("mm_token_type_ids"),
            image_position_ids=inputs.get("image_position_ids"),
        )
        mode = "train" if self.model.training else "eval"

        name = self.args.objective
        objective = get_objective(name)
        hparams = dict(self.args.objective_kwargs or {})
        hparams.setdefault("diagnostics", "clip")
        agg = hparams.pop("agg", objective.agg)
        norm_len = hparams.pop("norm_len", None)
        if agg == "seq_mean_token_sum_norm" and norm_len is None:
            norm_len = self.max_completion_length  # trl's dr_grpo constant

        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)  # [B, 1]
        old_per_token_logps = inputs.get("old_per_token_logps")
        # trl skips the behaviour log-probs when the batch is on-policy (num_iterations 1, no vLLM correction)
        old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps

        # trl's per-token factors on the policy term (no gradient): off-policy sequence mask, high-entropy mask,
        # vLLM importance-sampling ratio; the normaliser still counts every token of `mask`
        core_agg, factor, scale = self._aggregation(mask, agg, inputs, mode)
        weights, entropy_mask = None, None
        if self.off_policy_mask_threshold is not None:
            sampling_per_token_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)
            weights = self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=sampling_per_token_logps,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )  # [B, 1]
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            weights = entropy_mask if weights is None else weights * entropy_mask
        if self.use_vllm and self.vllm_importance_sampling_correction and "importance_sampling_ratio" in inputs:
            ratio = inputs["importance_sampling_ratio"]  # [B, T] or [B, 1], already truncated/masked
            weights = ratio if weights is None else weights * ratio

        extra = self._objective_inputs(objective, hparams, inputs, entropies)
        old = old_per_token_logps
        adv = advantages if advantages.shape == per_token_logps.shape else advantages.squeeze(-1)  # [B] or [B, T]
        if weights is not None:
            hparams["weights"] = weights
        loss, metrics = compute_policy_loss(
            name, per_token_logps, old, adv, mask, agg=core_agg, norm_len=norm_len, **extra, **hparams
        )
        loss = loss * factor

        # k3 KL to the reference model, reduced with the same normaliser (GRPO, arXiv:2402.03300 eq. 4)
        if self.beta != 0.0:
            bool_mask = mask.bool()
            delta = inputs["ref_per_token_logps"] - per_token_logps
            per_token_kl = torch.exp(delta) - delta - 1  # [B, T]
            if self.args.use_bias_correction_kl:  # unbiased reverse-KL gradient (DeepSeek-V3.2)
                log_ratio = torch.where(bool_mask, per_token_logps - old_per_token_logps.detach(), 0.0)
                if objective.log_ratio is gspo_log_ratio:  # trl's importance_sampling_level="sequence"
                    log_ratio = sequence_log_ratio(log_ratio, bool_mask)
                per_token_kl = per_token_kl * torch.exp(log_ratio)
            agg_weights = aggregation_weights(mask, core_agg, norm_len=norm_len) * factor  # [B, T]
            kl = torch.where(bool_mask, per_token_kl * agg_weights, 0.0).sum()
            loss = loss + self.beta * kl

        loss = self._add_entropy_bonus(loss, scale, entropies, mask, entropy_mask, mode)

        if self.aux_loss_enabled:  # MoE load-balancing loss, scaled for accumulation as in trl
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(self._global_masked_mean(per_token_kl, mask))
        self._metrics[mode]["entropy"].append(self._global_masked_mean(entropies, mask))
        self._log_flowrl_metrics(metrics, mask, mode)
        return loss

    def _add_entropy_bonus(self, loss, scale, entropies, mask, entropy_mask, mode):
        """trl's entropy bonus `L - coef * mean H` and its adaptive controller (Skywork-OR1, arXiv:2505.22312)."""
        if not getattr(self, "_entropy_bonus_enabled", False):
            return loss
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        if self.use_adaptive_entropy:
            apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            apply_coef = self.entropy_coef
        policy_loss = loss.detach() * scale  # trl logs the policy loss before its accumulation division
        loss = loss - apply_coef * entropy_loss
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
                args = self.args
                if world_entropy <= args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss

    def _reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over processes (the identity on one process, without a collective call)."""
        return values if self.accelerator.num_processes == 1 else self.accelerator.reduce(values, reduction="sum")

    def _global_masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        """Mean of `x [B, T]` over the valid tokens of every process (trl's `global_masked_mean`)."""
        total, count = torch.dot(x.reshape(-1), mask.reshape(-1)).detach(), mask.sum()
        if self.accelerator.num_processes > 1:
            total, count = self.accelerator.reduce(torch.stack([total, count]), reduction="sum").unbind()
        return (total / count.clamp(min=1.0)).item()

    def _log_flowrl_metrics(self, metrics: dict[str, torch.Tensor], mask: torch.Tensor, mode: str) -> None:
        """flowrl's scalar diagnostics as `flowrl/<name>`: token-weighted means over processes, min/max for extremes.

        `ratio_std` is the token-weighted mean of the processes' standard deviations (exact on one process).
        """
        scalars = {k: v.float() for k, v in metrics.items() if v.ndim == 0}  # compute_policy_loss's are detached
        extremes = {k: scalars.pop(k) for k in ("ratio_min", "ratio_max") if k in scalars}
        logged = self._metrics[mode]
        if scalars:
            if self.accelerator.num_processes == 1:  # one process: the means are the metrics themselves
                means = dict(zip(scalars, torch.stack(list(scalars.values())).tolist()))
            else:
                count = mask.sum().detach()
                totals = self._reduce_sum(torch.stack([*scalars.values(), torch.ones_like(count)]) * count)
                means = dict(zip(scalars, (totals[:-1] / totals[-1].clamp(min=1.0)).tolist()))
            for key, value in means.items():
                logged[f"flowrl/{key}"].append(value)
            if "clipfrac_low" in means and "clipfrac_high" in means:  # trl's names, for dashboards
                logged["clip_ratio/low_mean"].append(means["clipfrac_low"])
                logged["clip_ratio/high_mean"].append(means["clipfrac_high"])
                logged["clip_ratio/region_mean"].append(means["clipfrac_low"] + means["clipfrac_high"])
        if extremes:
            # one gather for both: min as -(-min) so a single max reduction serves
            signs = torch.tensor([-1.0 if k == "ratio_min" else 1.0 for k in extremes], device=mask.device)
            local = torch.stack(list(extremes.values())) * signs
            if self.accelerator.num_processes > 1:
                local = self.accelerator.gather(local.reshape(1, -1)).amax(0)
            for key, value in zip(extremes, (local * signs).tolist()):
                logged[f"flowrl/{key}"].append(value)
