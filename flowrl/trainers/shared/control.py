"""The control algorithms' base: on-policy actor-critic training on Gymnasium vector environments.

A control rollout is the third rollout kind (`flowrl.control.rollout.ControlRollout`): transitions of vectorised
environments. Each epoch collects `env.num_envs x env.steps_per_env` steps with GAE advantages (`flowrl.control`),
adds the behaviour policy's per-element log-probs `[B, K]` (computed once after collection in training-sized chunks,
so the ratio is 1 at the old weights), then the update scheduler runs `batch.inner_epochs` passes of shuffled
mini-batches of `batch.mini_batch_size` transitions: each micro-batch's policy loss is one `compute_policy_loss`
call on `[b, K]` (K = 1 for a Gaussian action, FPO's draws, or the K denoising steps of a flow policy's chain) plus
`vf_coef` times the value loss (a per-row loss, averaged over the mini-batch's transitions), one optimizer step with
one gradient-norm clip over both networks (SB3's and CleanRL's PPO); `advantage.normalize` whitens each mini-batch's
advantages over every process, `objective.target_kl` stops the update early.

A control algorithm is a subclass with its config and three hooks: `build_actor`, `behaviour` (the behaviour
policy's `[B, K]` log-probs and any stored draws) and `policy_terms`. `ActorCriticAlgorithm` (`ppo`, `fpo`, `dppo`,
on an `ActorCriticConfig`) adds the value loss, the whitened advantages and the value fit's diagnostics;
`ControlAlgorithm` alone is what behaviour cloning needs (its loss is `policy_terms`).
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar

import torch

from flowrl.control.config import ActorCriticConfig, ControlConfig
from flowrl.control.modality import ControlModality
from flowrl.core import normalize
from flowrl.core.terms import Terms
from flowrl.run.algorithm import Algorithm


class ControlAlgorithm(Algorithm):
    """The control algorithms' base; see the module docstring."""

    config_class = ControlConfig
    modality_class: ClassVar[type] = ControlModality
    optimizer_options = {"adamw": {"fused": True}, "rmsprop": {"foreach": True}}
    shard_refusal = "control policies are small MLPs: shard nothing, run DDP (run.shard: none)"
    keeps_chain: ClassVar[bool] = False
    """Collection keeps a flow policy's stochastic denoising chain (the denoising MDP: `dppo`)."""

    def __init__(self, config, modality, engine):
        super().__init__(config, modality, engine)
        torch.manual_seed(config.run.seed)  # the initial weights are the seed's
        modality.attach(self.build_actor(modality.obs_dim, modality.act_dim))
        if config.init_from:
            self.init_actor(config.init_from)

    def init_actor(self, source: str) -> None:
        """Copy the policy network of the run or checkpoint `source` (`init_from`) into this run's actor."""
        from flowrl.run.inference import load_run

        loaded = load_run(source, device="cpu", overrides=["init_from=null"])
        theirs, cfg = loaded.algorithm.policy.actor, loaded.config
        mine = self.policy.actor
        if cfg.env.id != self.config.env.id:
            raise ValueError(
                f"init_from {source}: that run's policy acts in {cfg.env.id}, this run's in {self.config.env.id}"
            )
        if cfg.env.normalize_obs:
            raise ValueError(
                f"init_from {source}: that run normalised its observations; its policy cannot start "
                "this one (the statistics do not carry)"
            )
        shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
        if type(theirs) is not type(mine) or shapes != {k: tuple(v.shape) for k, v in mine.state_dict().items()}:
            raise ValueError(
                f"init_from {source}: its {cfg.trainer} policy ({type(theirs).__name__}) is not this "
                f"run's network ({type(mine).__name__}); match the policy section's sizes"
            )
        with torch.no_grad():
            mine.load_state_dict(theirs.state_dict())

    # ------------------------------------------------------------------------------------------
    # the algorithm's hooks
    # ------------------------------------------------------------------------------------------

    @abstractmethod
    def build_actor(self, obs_dim: int, act_dim: int) -> torch.nn.Module:
        """The policy network (`act(obs, generator, deterministic)` samples it)."""

    @abstractmethod
    def behaviour(self, rollout, rows: torch.Tensor, size: int) -> tuple[torch.Tensor, object]:
        """`(log_probs [B, K], draws or None)` of the behaviour policy for this process's transitions (at positions
        `rows` of the epoch's `size`), computed after collection."""

    @abstractmethod
    def policy_terms(self, batch, index: torch.Tensor) -> Terms:
        """The policy's loss inputs (`[b, c]`) of the elements `index` of the transitions `batch`."""

    def trained_module(self) -> torch.nn.Module:
        return self.policy  # the actor and the value MLP, one optimizer

    def collector(self):
        return self.modality.collector(chain=self.keeps_chain)

    def evaluator(self):
        return self.modality.evaluator(chain=self.keeps_chain)

    def chunks(self, n: int) -> list[torch.Tensor]:
        """Row ranges of a rollout of `n` in training-sized chunks (behaviour passes use the training shapes)."""
        size = self.config.batch.micro_batch_size
        return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]

    # ------------------------------------------------------------------------------------------
    # the epoch
    # ------------------------------------------------------------------------------------------

    def advantages(self, collected, valid):
        """Every process's GAE advantages, by transition (`[N]`)."""
        return self.processes.gather_at(collected.data.advantages, collected.rows, collected.size), {}

    @torch.no_grad()
    def prepare(self, collected, advantages, trainable, epoch):
        """The behaviour log-probs (and draws) at the weights that collected the epoch."""
        rollout = collected.data
        log_probs, draws = self.behaviour(rollout, collected.rows, collected.size)
        rollout = dataclasses.replace(rollout, log_probs=log_probs, draws=draws)
        return self.update_batch(collected, advantages, trainable, data=rollout), {}

    def num_elements(self, data) -> int:
        return data.log_probs.shape[1]

    def terms(self, batch, index):
        """The policy's terms alone."""
        return self.policy_terms(batch.data, index)


class ActorCriticAlgorithm(ControlAlgorithm):
    """The control RL algorithms' base: the policy's terms plus the value loss; see the module docstring."""

    config_class = ActorCriticConfig

    def mini_batch_advantages(self, advantages):
        """Whitened over the whole mini-batch (every process's transitions) with `advantage.normalize`."""
        if self.config.advantage.normalize and len(advantages) > 1:
            return normalize(advantages)
        return advantages

    def terms(self, batch, index):
        """The policy's terms plus `vf_coef` times the value loss, a per-row loss (logged as `value_loss`)."""
        data = batch.data
        terms = self.policy_terms(data, index)
        if self.epoch < self.config.critic.warmup_epochs:  # critic warm-up: the value network trains alone
            terms.logp = terms.logp.detach()
        values = self.policy.value(data.obs)
        per_row = (values - data.returns).square()
        if self.config.clip_vf is not None:
            clip = self.config.clip_vf
            clipped = data.values + (values - data.values).clamp(-clip, clip)
            per_row = torch.maximum(per_row, (clipped - data.returns).square())
        terms.row_loss = self.config.vf_coef * per_row
        terms.logs["value_loss"] = per_row.detach()[:, None].expand(index.shape)
        return terms

    def finish(self, batch, epoch):
        """The value function's fit over every process's transitions."""
        values = self.processes.gather(torch.stack([batch.data.returns, batch.data.values], 1).double())  # [N, 2]
        residual = (values[:, 0] - values[:, 1]).var()
        return {
            "explained_variance": float(1 - residual / values[:, 0].var().clamp_min(1e-12)),
            "value_mean": float(values[:, 1].mean()),
        }
