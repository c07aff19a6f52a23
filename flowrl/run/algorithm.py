"""What an algorithm is to the loop: a small class that supplies advantages, the loss for a batch and extra models.

The run driver (`flowrl.run.driver.Trainer`) calls the hooks in this order each epoch, one meaning each:

1. `advantages(collected, valid)`: the advantage of every sample of the epoch, before any learned baseline;
2. `prepare(collected, advantages, trainable, epoch)`: the `UpdateBatch` the update trains on (behaviour log-probs,
   flow-matching draws, a critic's weights, a replay buffer's draws), plus diagnostics;
3. the update scheduler then calls `elements` (which of each row's K elements train), `mini_batch_advantages` (a
   mini-batch's advantages, e.g. whitened), `terms` (the per-element loss inputs of a micro-batch: **the loss for a
   batch**; likelihood-free losses return `Terms.loss` instead of log-probs) and `after_step`;
4. `finish(batch, epoch)`: what follows the epoch's update (an old policy's soft update), plus diagnostics.

Before the optimizer exists, `build` makes the algorithm's own models (critics, noise policies, replay buffers);
`trained_module` names the module the optimizer trains and `auxiliary_modules` the networks with optimizers of their
own. Class attributes declare the rest: `needs_reference` (a frozen reference model), `updates_groups` (mini-batches of
whole groups), `couples_rows` (a loss defined on the whole mini-batch), `shard_refusal`.

A modality's base class (`ImageAlgorithm`, `ControlAlgorithm`, `TextAlgorithm`) connects an algorithm to its
modality's collector and evaluator; the registry (`flowrl.run.registry.register`) names it once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from flowrl.core import get_objective
from flowrl.core.objectives import uses_batch_statistics
from flowrl.core.terms import Terms
from flowrl.run.advantages import AdvantageEstimator
from flowrl.run.scheduler import MicroBatch, UpdateBatch
from flowrl.sections import HasKL, HasObjective


class Algorithm(ABC):
    """Base class; see the module docstring.

    Args:
        config: the trainer's config (its `config_class`).
        modality: the modality's parts (`ImageModality`, `ControlModality`, `TextModality`): the policy, rewards, ...
        engine (`Engine`): device, processes and, once prepared, the trained module (`engine.model`).
    """

    name: ClassVar[str] = ""
    """The registered name (set by `register`)."""
    config_class: ClassVar[type]
    image_scale: ClassVar[bool] = False
    """Whether the log-probs are means over latent elements (images): the objective's image-scale defaults apply
    to every hyper-parameter the config does not set (`flowrl.core.IMAGE_SCALE`, docs/objectives.md)."""
    updates_groups: ClassVar[bool] = False
    """Whether mini-batches are whole groups (shuffled as units): a loss that compares a group's samples."""
    couples_rows: ClassVar[bool] = False
    """Whether the loss of a batch couples its rows (beyond the objective's batch statistics): it is then computed
    on the whole mini-batch (`flowrl.run.scheduler`)."""
    element_calls: ClassVar[bool] = False
    """Whether each element column is scored by network calls of its own (an image's denoising steps, flow-matching
    draws), so a backward per column frees that column's activations (`batch.backward: auto` runs it); tokens and
    action dimensions share one call per row."""
    shard_refusal: ClassVar[str | None] = None
    """Why this algorithm cannot shard its model (`run.shard`: FSDP2 or ZeRO), or None."""

    optimizer_options: ClassVar[dict[str, dict]] = {}
    """Extra keyword arguments of each `optim.optimizer` (control's small networks: fused AdamW)."""

    def __init__(self, config, modality, engine):
        self.config, self.modality, self.engine = config, modality, engine
        self.processes = engine.processes
        objective = config.objective if isinstance(config, HasObjective) else None  # a ratio objective of the core
        self.objective: str | None = objective.name if objective is not None else None
        self.objective_hparams: dict[str, Any] = {}
        if self.objective is not None:
            presets = get_objective(self.objective).image_hparams if self.image_scale else {}
            self.objective_hparams = {**presets, **objective.hparams()}  # what the user sets wins
        spec = get_objective(self.objective) if self.objective else None
        self.batch_statistics = uses_batch_statistics(spec, self.objective_hparams)
        """Whether the objective reduces over the global batch in each call."""
        self.agg = self.objective_hparams.get("agg") or (spec.agg if spec else "token_mean")
        self.target_kl: float | None = objective.target_kl if objective is not None else None
        self.estimator = AdvantageEstimator.of(config)

    @property
    def policy(self):
        return self.modality.policy

    @property
    def epoch(self) -> int:
        """The epoch being trained (set by the driver before each)."""
        return getattr(self, "_epoch", 0)

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch = value

    # ------------------------------------------------------------------------------------------
    # models
    # ------------------------------------------------------------------------------------------

    def needs_reference(self) -> bool:
        """Whether the loss compares the policy with a frozen reference (full fine-tuning then keeps a copy)."""
        return isinstance(self.config, HasKL) and self.config.kl.beta > 0

    def build(self) -> None:  # noqa: B027  (an optional hook)
        """Build the algorithm's own models and state before the optimizers exist (critics, buffers, ...)."""

    def trained_module(self) -> torch.nn.Module:
        """The module the main optimizer trains (default: the policy's network)."""
        return self.policy.model

    def auxiliary_modules(self) -> dict[str, tuple[torch.nn.Module, float]]:
        """`{name: (module, learning rate)}` of networks trained by their own optimizer (critics, value nets)."""
        return {}

    # ------------------------------------------------------------------------------------------
    # the epoch
    # ------------------------------------------------------------------------------------------

    def group_keys(self, texts: list[str]) -> list:
        """The baseline group of each of the epoch's samples (`[N]` hashables): its prompt."""
        return texts

    def advantages(self, collected, valid: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """`(advantages [N], stats)` of the epoch's samples from the `advantage` section (0 where not `valid`)."""
        from flowrl.prompts import group_key  # per-prompt statistics: an editing prompt is its (text, source) pair

        texts = [group_key(p) for p in collected.prompts]
        group_ids = collected.group_ids
        adv = torch.zeros(len(texts))
        rewards = {k: v[valid] for k, v in collected.rewards.items()}
        kept = [t for t, ok in zip(texts, valid.tolist()) if ok]
        values, stats = self.estimator(rewards, group_ids[valid], kept)
        adv[valid] = values.float()
        return adv, stats

    def prepare(self, collected, advantages: torch.Tensor, trainable: torch.Tensor, epoch: int):
        """`(UpdateBatch, stats)`: what the update trains on (default: the collected rows and their advantages)."""
        return self.update_batch(collected, advantages, trainable), {}

    def update_batch(self, collected, advantages: torch.Tensor, trainable: torch.Tensor, data=None) -> UpdateBatch:
        """The epoch's rows as an `UpdateBatch` (`data` replaces the collected rows, same order)."""
        return UpdateBatch(
            data=collected.data if data is None else data,
            rows=collected.rows,
            size=collected.size,
            advantages=advantages,
            trainable=trainable,
            group_ids=collected.group_ids,
            rewards=collected.total,
        )

    def mini_batch_advantages(self, advantages: torch.Tensor) -> torch.Tensor:
        """A mini-batch's advantages (every process's rows of it) as its loss uses them (control: whitened)."""
        return advantages

    @abstractmethod
    def num_elements(self, data) -> int:
        """K, the elements per row of `data` (the `[B, K]` layout the core sees)."""

    def elements(self, batch: UpdateBatch, epoch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(index [B, k], valid [B, k] or None)`: the elements each row of `batch.data` trains, in
        `[0, num_elements)`, and which of them are real (None: all)."""
        k = self.num_elements(batch.data)
        return torch.arange(k).expand(len(batch.data), k), None

    @abstractmethod
    def terms(self, batch: MicroBatch, index: torch.Tensor) -> Terms:
        """The loss inputs (`[b, c]` each) of the elements `index [b, c]` of the micro-batch `batch`."""

    def after_step(self) -> None:  # noqa: B027  (an optional hook)
        """After each optimizer step (FIND keeps its noise std above its floor)."""

    def finish(self, batch: UpdateBatch, epoch: int) -> dict:
        """After the epoch's update; returns diagnostics."""
        return {}

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------

    def lagged_copies(self) -> list:
        """Parameter copies the algorithm keeps beside the policy (`flowrl.run.state.EMA`: DiffusionNFT's old
        policy, AWM's KL-EMA copy, DGPO's lagged copy), each with its own prefix; checkpointed with the run."""
        return []

    def sampling_copies(self) -> list:
        """The lagged copies the sampler reads (DiffusionNFT's old policy): the rollout workers of `run.mode: async`
        receive them with the trained weights."""
        return []

    def state_dict(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """The algorithm's resumable state: `(JSON part, tensors)`."""
        state = self.estimator.state_dict() if self.estimator is not None else {}
        tensors = {name: t for copy in self.lagged_copies() for name, t in copy.state_dict().items()}
        return ({"advantage": state} if state else {}), tensors

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        if self.estimator is not None:
            self.estimator.load_state_dict(state.get("advantage", {}))
        for copy in self.lagged_copies():
            copy.load_state_dict(tensors)
