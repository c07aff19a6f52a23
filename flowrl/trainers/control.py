"""The control modality on the shared loop: on-policy actor-critic training on Gymnasium vector environments.

A control rollout is the third rollout kind (`flowrl.control.rollout.ControlRollout`): transitions of
vectorised environments. Each epoch collects `env.num_envs x env.steps_per_env` steps, computes GAE with the
value MLP, then runs `inner_epochs` passes of shuffled minibatches of `minibatch_size` transitions; each
minibatch's policy loss is one `compute_policy_loss` call on `[b, K]` (K = 1 for a Gaussian action, FPO's
draws, or the K denoising steps of a flow policy's chain), plus `vf_coef` times the value loss, one optimizer
step with one gradient-norm clip over both networks (SB3's and CleanRL's PPO).

A control algorithm is a `ControlTrainer` subclass with its config and four hooks: `build_actor`, `act`
(sampling during collection), `behaviour` (the behaviour policy's per-element log-probs `[B, K]`, computed once
after collection in training-sized chunks so the ratio is 1 at the old weights) and `score`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from abc import abstractmethod
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from flowrl.config import EvalConfig, OptimConfig, RewardConfig, RunConfig, TrainerConfig
from flowrl.control.collect import ControlCollector, ControlEvaluator
from flowrl.control.envs import BIMODAL_ID, Normalizer, make_vec_env
from flowrl.control.policies import ActorCritic
from flowrl.core import normalize
from flowrl.trainers.base import Trainer
from flowrl.trainers.state import seeded
from flowrl.trainers.update import EpochStats


@dataclasses.dataclass
class EnvConfig:
    """The Gymnasium environments (the `rl` extra: `pip install 'flowrl[rl]'`)."""

    id: str = "Pendulum-v1"
    """A registered Gymnasium id with a Box action space (`Pendulum-v1`, `HalfCheetah-v5`, `Hopper-v5`,
    `flowrl/BimodalPointMass-v0`, ...)."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of `gymnasium.make`."""
    num_envs: int = 4
    """Environments stepped together (one `SyncVectorEnv`)."""
    steps_per_env: int = 1024
    """Steps per environment per epoch: an epoch's rollout has `num_envs * steps_per_env` transitions."""
    normalize_obs: bool = False
    """Normalise observations by running statistics (SB3's `VecNormalize`); frozen within an epoch's update."""
    normalize_reward: bool = False
    """Divide rewards by the running std of the discounted return (SB3's `VecNormalize`)."""
    clip_obs: float = 10.0
    """Clip normalised observations to `[-clip_obs, clip_obs]`."""
    clip_reward: float = 10.0
    """Clip scaled rewards to `[-clip_reward, clip_reward]`."""


@dataclasses.dataclass
class ControlEvalConfig:
    """Evaluation episodes on the environment."""

    every: int = 10
    """Evaluate every this many epochs (and always before the first and after the last); 0: start and end only."""
    episodes: int = 10
    """Episodes per evaluation, from the same seeds each time."""
    deterministic: bool = True
    """Evaluation actions: the Gaussian's mean, a flow's integration from zero noise (FPO++'s zero-sampling);
    False samples as in training."""
    seed: int = 1234
    """Seed of the evaluation episodes (and of the stochastic probes)."""
    best_metric: str | None = None
    """Keep `checkpoints/best` by this evaluation metric (`reward`, ...; a leading `-`: lowest); None: no best."""
    restore_best: bool = False
    """At the end of the run, restore the best checkpoint's weights."""
    stop_on_drop: float | None = None
    """Stop the run when `best_metric` falls this far below its best evaluation; None: never stop early."""

    metrics: ClassVar[tuple[str, ...]] = ()  # no gold metrics: the environment's return is the measure
    best_key = EvalConfig.best_key
    __post_init__ = EvalConfig.__post_init__


@dataclasses.dataclass
class CriticConfig:
    """The value MLP `V(obs)`."""

    hidden: int = 64
    """Hidden width."""
    depth: int = 2
    """Hidden layers."""
    activation: Literal["tanh", "relu", "silu"] = "tanh"
    """Activation."""


def _control_optim() -> OptimConfig:
    # SB3 / CleanRL PPO: Adam (weight decay 0), eps 1e-5, gradient-norm clip 0.5
    return OptimConfig(lr=3e-4, weight_decay=0.0, eps=1e-5, max_grad_norm=0.5)


def _control_run() -> RunConfig:
    return RunConfig(epochs=25, save_every=0, images_every=0)


@dataclasses.dataclass
class ControlConfig(TrainerConfig):
    """What the control trainers share: environments, GAE, minibatches, the value loss."""

    unused: ClassVar[tuple[str, ...]] = ("model", "sampling", "prompts", "advantage", "kl", "steps")

    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """The environments."""
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    """The value network."""
    rewards: list[RewardConfig] = dataclasses.field(default_factory=list)
    """Unused: the environment's reward is the reward."""
    eval: ControlEvalConfig = dataclasses.field(default_factory=ControlEvalConfig)
    """Evaluation episodes."""
    optim: OptimConfig = dataclasses.field(default_factory=_control_optim)
    """The optimizer of the policy and the value network together."""
    run: RunConfig = dataclasses.field(default_factory=_control_run)
    """Run folder, epochs, seeds, logging, checkpoints."""
    total_env_steps: int | None = None
    """Environment-step budget; when set, `run.epochs = ceil(total_env_steps / (num_envs * steps_per_env))`."""
    inner_epochs: int = 10
    """Passes over each epoch's transitions (PPO epochs; SB3: 10)."""
    minibatch_size: int = 64
    """Transitions per minibatch (SB3's `batch_size`: 64)."""
    gamma: float = 0.99
    """Discount."""
    gae_lambda: float = 0.95
    """GAE lambda (1: Monte-Carlo returns with a baseline)."""
    normalize_advantage: bool = True
    """Whiten advantages per minibatch (SB3, CleanRL)."""
    vf_coef: float = 0.5
    """Weight of the value loss `mean((V - returns)^2)` (SB3's MSE without 1/2)."""
    clip_vf: float | None = None
    """Clip the value prediction to `values_old +- clip_vf` (CleanRL's value clipping; SB3: off)."""
    ent_coef: float = 0.0
    """Entropy bonus (policies with an entropy: the Gaussian)."""
    target_kl: float | None = None
    """Stop the epoch's update once a minibatch's approximate KL exceeds `1.5 * target_kl` (SB3); None: never."""

    def __post_init__(self):
        if self.total_env_steps is not None:
            if self.total_env_steps < 1:
                raise ValueError("total_env_steps must be >= 1")
            self.run.epochs = max(1, math.ceil(self.total_env_steps / (self.env.num_envs * self.env.steps_per_env)))
        super().__post_init__()

    def checks(self) -> list[tuple[bool, str]]:
        e = self.env
        return [
            (self.run.epochs >= 1, "run.epochs must be >= 1"),
            (self.inner_epochs >= 1, "inner_epochs must be >= 1"),
            (e.num_envs >= 1 and e.steps_per_env >= 1, "env.num_envs and env.steps_per_env must be >= 1"),
            (self.minibatch_size >= 1, "minibatch_size must be >= 1"),
            (0 < self.gamma <= 1 and 0 <= self.gae_lambda <= 1, "gamma must lie in (0, 1], gae_lambda in [0, 1]"),
            (self.vf_coef >= 0 and self.ent_coef >= 0, "vf_coef and ent_coef must be >= 0"),
            (not self.rewards, "control trainers take their reward from the environment; remove the rewards section"),
            (self.optim.gradient_accumulation == 1, "control trainers step once per minibatch: "
             "optim.gradient_accumulation must be 1 (raise minibatch_size instead)"),
            (self.ema_decay is None or 0 < self.ema_decay < 1, "ema_decay must lie in (0, 1)"),
            (self.eval.episodes >= 1, "eval.episodes must be >= 1"),
        ]  # fmt: skip


class ControlTrainer(Trainer):
    """The control loop: collection, GAE, minibatch epochs with the value loss (see the module docstring)."""

    config_class = ControlConfig
    optimizer_options = {"adamw": {"fused": True}, "rmsprop": {"foreach": True}}

    # ------------------------------------------------------------------------------------------
    # the algorithm's hooks
    # ------------------------------------------------------------------------------------------

    @abstractmethod
    def build_actor(self, obs_dim: int, act_dim: int) -> torch.nn.Module:
        """The policy network (`act(obs, generator, deterministic)` samples it)."""

    def act(self, obs: torch.Tensor, generator: torch.Generator):
        """`(actions [E, A], chain or None)` for the observations of the environments (collection)."""
        return self.policy.actor.act(obs, generator), None

    def eval_act(self, obs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.policy.actor.act(obs, generator, deterministic=self.config.eval.deterministic)

    @abstractmethod
    def behaviour(self, rollout) -> tuple[torch.Tensor, object]:
        """`(log_probs [B, K], draws or None)` of the behaviour policy, computed after collection."""

    # ------------------------------------------------------------------------------------------
    # the modality's parts
    # ------------------------------------------------------------------------------------------

    def build_rewards(self, specs) -> dict:
        return {}

    def check_inputs(self) -> None:
        """The environment exists and has vector observations and a Box action space (before any network)."""
        env = self.config.env
        probe = make_vec_env(env.id, 1, env.kwargs)
        obs_shape, act_shape = probe.single_observation_space.shape, probe.single_action_space.shape
        probe.close()
        if obs_shape is None or len(obs_shape) != 1:
            raise ValueError(f"{env.id} has observations of shape {obs_shape}; control policies take vectors")
        self.obs_dim, self.act_dim = int(obs_shape[0]), int(np.prod(act_shape))
        limit = probe.envs[0].spec.max_episode_steps if probe.envs[0].spec is not None else None
        if limit is not None and limit > env.steps_per_env and self.is_main:
            # every epoch starts fresh episodes: shorter rollouts never see the episode's later states
            print(f"warning: {env.id} episodes last up to {limit} steps but env.steps_per_env is "
                  f"{env.steps_per_env}: training never sees an episode past step {env.steps_per_env} (raise "
                  "env.steps_per_env, lower env.num_envs to keep the batch)", flush=True)  # fmt: skip

    def build_policy(self) -> ActorCritic:
        c = self.config.critic
        torch.manual_seed(self.config.run.seed)  # the initial weights are the seed's
        actor = self.build_actor(self.obs_dim, self.act_dim)
        return ActorCritic(actor, self.obs_dim, hidden=c.hidden, depth=c.depth, activation=c.activation)

    def trained_module(self) -> torch.nn.Module:
        return self.policy

    def setup(self) -> None:
        env = self.config.env
        self.normalizer = Normalizer(self.obs_dim, env.num_envs, obs=env.normalize_obs, reward=env.normalize_reward,
                                     gamma=self.config.gamma, clip_obs=env.clip_obs,
                                     clip_reward=env.clip_reward)  # fmt: skip

    def build_collector(self) -> ControlCollector:
        cfg, env = self.config, self.config.env
        return ControlCollector(env.id, env.num_envs, env.steps_per_env, env.kwargs, self.normalizer, self.act,
                                self.policy.value, self.behaviour, gamma=cfg.gamma, lam=cfg.gae_lambda,
                                seed=cfg.run.seed, processes=self.processes)  # fmt: skip

    def build_evaluator(self) -> ControlEvaluator:
        env, ev = self.config.env, self.config.eval
        extra = None
        if env.id == BIMODAL_ID:
            from flowrl.control.bimodal import bimodal_metrics

            extra = lambda act: bimodal_metrics(act, seed=ev.seed)  # noqa: E731
        return ControlEvaluator(env.id, env.kwargs, ev.episodes, ev.seed, self.normalizer, self.eval_act,
                                lambda obs, g: self.act(obs, g)[0], extra)  # fmt: skip

    def chunks(self, n: int) -> list[torch.Tensor]:
        """Row ranges of a rollout of `n` in training-sized chunks (behaviour passes use the training shapes)."""
        size = self.config.minibatch_size
        return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]

    # ------------------------------------------------------------------------------------------
    # elements
    # ------------------------------------------------------------------------------------------

    def num_elements(self, rollout) -> int:
        return rollout.log_probs.shape[1]

    def train_elements(self, rollout, epoch: int) -> torch.Tensor:
        k = self.num_elements(rollout)
        return torch.arange(k).expand(len(rollout), k)

    # ------------------------------------------------------------------------------------------
    # one epoch
    # ------------------------------------------------------------------------------------------

    def train_epoch(self, epoch: int) -> dict:
        start = time.time()
        threads, lr = self.begin_epoch(epoch)
        self.policy.eval()
        batch = self.collector.collect(epoch)
        self.state.samples_scored += batch.env_steps
        t0 = time.time()
        train = self.update(batch.rollout, batch.rollout.advantages, None, epoch)
        elapsed = time.time() - start
        returns = batch.episode_returns
        record = {
            "epoch": epoch + 1,
            "reward/mean": float(np.mean(returns)) if returns else float("nan"),
            "reward/std": float(np.std(returns)) if returns else float("nan"),
            "episodes": len(returns),
            "episode_length": float(np.mean(batch.episode_lengths)) if returns else float("nan"),
            "env_steps": self.state.samples_scored,
            "env_steps_per_s": batch.env_steps / max(elapsed, 1e-9),
            "lr": lr,
            "threads": threads,
            **train,
            **batch.times,
            "time/train_s": time.time() - t0,
            "time_s": elapsed,
        }
        self.last_epoch = batch if self.is_main else None
        return record

    def update(self, rollout, advantages: torch.Tensor, trainable, epoch: int) -> dict:
        """`inner_epochs` passes of shuffled minibatches: policy loss on `[b, K]` + `vf_coef` x value loss.

        The minibatches are cut from the epoch's transitions of every process, shuffled the same way on every
        process; each trains the minibatch's rows it holds, weighted by their share of the minibatch, and
        `optimizer_step` sums the gradients. Advantage whitening and `target_kl` use the whole minibatch's
        statistics, so a step is the same on one process or many.
        """
        cfg = self.config
        index = self.train_elements(rollout, epoch)
        n_local = len(rollout)
        rows = rollout.rows if rollout.rows is not None else torch.arange(n_local)
        everyone = self.processes.gather(torch.stack([rows.double(), rollout.advantages.double()], 1))  # [N, 2]
        n = len(everyone)
        adv_all = torch.empty(n, dtype=rollout.advantages.dtype)
        adv_all[everyone[:, 0].long()] = everyone[:, 1].to(adv_all.dtype)  # [N] by row of the whole rollout
        local = torch.full((n,), -1, dtype=torch.long)
        local[rows] = torch.arange(n_local)  # the whole rollout's row -> this process's row (-1: another's)
        stats = EpochStats()
        self.policy.train()
        for inner in range(cfg.inner_epochs):
            # the same order on every process (the trailing 0 keeps the stream one process always drew)
            order = torch.randperm(n, generator=seeded(cfg.run.seed, epoch, 3, inner, 0))
            stop = False
            for start in range(0, n, cfg.minibatch_size):
                window = order[start : start + cfg.minibatch_size]  # the minibatch's rows, of every process
                adv = adv_all[window]
                if cfg.normalize_advantage and len(window) > 1:
                    adv = normalize(adv)
                mine = local[window] >= 0
                mb = local[window][mine]
                metrics = {}
                if len(mb):
                    batch = rollout.select(mb)
                    share = len(mb) / len(window)  # every row has the same K elements: rows and elements agree
                    scale = 1.0 if self.agg == "sum" else share
                    value_loss = self.value_loss(batch)
                    metrics = self.train_minibatch(batch, index[mb], adv[mine], scale=scale,
                                                   extra_loss=cfg.vf_coef * value_loss * share / scale)  # fmt: skip
                    metrics["value_loss"] = value_loss.detach()
                elif self.batch_statistics:  # the objective reduces over the processes: call it in step
                    self.train_padded(rollout, index, rollout.advantages, mb, 1, scale=0.0)
                if cfg.target_kl is not None:
                    kl = self.processes.sum(float(metrics.get("approx_kl", 0.0)) * len(mb)) / len(window)
                    if kl > 1.5 * cfg.target_kl:
                        self.optimizer.zero_grad(set_to_none=True)  # SB3: stop before this minibatch's step
                        stats.add_scalar("early_stop_epoch", inner + 1, shared=True)
                        stop = True
                        break
                stats.add(metrics, weight=len(mb) * index.shape[1])
                stats.add_scalar("grad_norm", self.optimizer_step(reduction="sum"), shared=True)
            if stop:
                break
        out = stats.summary(self.processes)
        values = self.processes.gather(torch.stack([rollout.returns, rollout.values], 1).double())  # [N, 2]
        residual = (values[:, 0] - values[:, 1]).var()
        out["explained_variance"] = float(1 - residual / values[:, 0].var().clamp_min(1e-12))
        out["value_mean"] = float(values[:, 1].mean())
        return out

    def value_loss(self, batch) -> torch.Tensor:
        """`mean((V(obs) - returns)^2)`, with CleanRL's clipped variant when `clip_vf` is set."""
        values = self.policy.value(batch.obs)
        loss = (values - batch.returns).square()
        if self.config.clip_vf is not None:
            clipped = batch.values + (values - batch.values).clamp(-self.config.clip_vf, self.config.clip_vf)
            loss = torch.maximum(loss, (clipped - batch.returns).square())
        return loss.mean()

    # ------------------------------------------------------------------------------------------
    # checkpoints and pictures
    # ------------------------------------------------------------------------------------------

    def state_dict(self):
        state, tensors = super().state_dict()
        for key, value in self.normalizer.state().items():
            tensors[f"normalizer.{key}"] = torch.from_numpy(np.asarray(value, np.float64).reshape(-1).copy())
        return state, tensors

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        norm = {k.removeprefix("normalizer."): v.numpy() for k, v in tensors.items() if k.startswith("normalizer.")}
        rest = {k: v for k, v in tensors.items() if not k.startswith("normalizer.")}
        super().load_state_dict(state, rest)
        if norm:
            vectors = ("obs.mean", "obs.var")  # the rest were scalars, saved as one-element tensors
            self.normalizer.load({k: v if k in vectors else v.reshape(()) for k, v in norm.items()})

    def log_samples(self) -> None:
        """The bimodal task: the action field and trajectories from the saddle (`images/epoch_N.png`)."""
        if not self.is_main or self.config.env.id != BIMODAL_ID:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from flowrl.control.bimodal import plot_bimodal

        fig, ax = plt.subplots(figsize=(4, 4))
        plot_bimodal(self.evaluator.raw_stochastic_act, ax, seed=self.config.eval.seed,
                     title=f"{self.config.trainer}, epoch {self.epoch}")  # fmt: skip
        fig.tight_layout()
        fig.savefig(self.output_dir / "images" / f"epoch_{self.epoch:04d}.png", dpi=100)
        plt.close(fig)
